"""Family `compound`: several writes for one user in a single request, some depending on each other (a new
default address that a pending order must also be shipped to; a payment change and an address change on the
same order while another order is cancelled).

Difficulty (number of writes and how the user is identified):
  0 — 2 writes: change the default address, then ship a pending order to that same new address (e-mail).
  1 — 2 writes of different kinds from: default address, order address, order payment, cancel, return (e-mail).
  2 — 3 writes; cancel reasons are paraphrased (e-mail).
  3 — 4 writes; cancel reasons paraphrased; the user gives name + zip instead of an e-mail.
"""

from __future__ import annotations

import functools
import random

from trace_core.envs.procedural import _retail as R
from trace_core.schemas import Instance

FAMILY = "compound"
N_WRITES = {0: 2, 1: 2, 2: 3, 3: 4}
KINDS = ("user_address", "order_address", "order_payment", "cancel", "return")
CONNECTIVES = {2: ("First,", "Then"), 3: ("First,", "Then", "Finally,"), 4: ("First,", "Then", "Also,", "Finally,")}


@functools.lru_cache(maxsize=1)
def _users_with_pending() -> tuple[str, ...]:
    ix = R.index()
    return tuple(u for u in ix.user_ids if ix.orders_of(u, "pending"))


def _plan(rng: random.Random, difficulty: int, pool: tuple[tuple[str, ...], ...] | None = None):
    """Choose a user and `N_WRITES[difficulty]` write kinds with concrete targets, or None to redraw. `pool`: the
    kinds are one of these tuples instead (a kind may repeat: "cancel" twice cancels two different orders)."""
    d = R.db()
    ix = R.index()
    user = d.users[rng.choice(_users_with_pending())]
    k = N_WRITES[difficulty]
    if pool is not None:
        kinds = list(rng.choice(pool))
    else:
        kinds = ["user_address", "order_address"] if difficulty == 0 else rng.sample(KINDS, k)
    pending = ix.orders_of(user.user_id, "pending")
    rng.shuffle(pending)
    delivered = ix.orders_of(user.user_id, "delivered")

    # The order whose address/payment changes (one order takes both), and a different one to cancel.
    modified = pending[0] if ("order_address" in kinds or "order_payment" in kinds) else None
    free = [o for o in pending if o != modified]
    to_cancel = free[: kinds.count("cancel")]  # a different pending order for each cancellation
    if len(to_cancel) < kinds.count("cancel"):
        return None
    steps = []
    new_default = None
    if "user_address" in kinds:
        new_default = R.new_address(rng, avoid=[R.address_dict(user.address)])
    # Keep the dependency readable: the default address is changed before an order is sent "there".
    if "user_address" in kinds and "order_address" in kinds:
        kinds.remove("user_address")
        kinds.insert(kinds.index("order_address"), "user_address")
    for kind in kinds:
        if kind == "user_address":
            steps.append(
                {
                    "kind": kind,
                    "text": f"update my default address to {R.speak_address(new_default)}",
                    "reads": [],
                    "write": R.act("modify_user_address", user_id=user.user_id, **R.address_args(new_default)),
                    "order_id": None,
                }
            )
        elif kind == "order_address":
            order = d.orders[modified]
            if new_default is not None:
                addr = new_default
                text = f"ship my pending order {modified} to that new address as well"
            else:
                addr = R.new_address(rng)
                text = f"ship my pending order {modified} to {R.speak_address(addr)}"
            if addr == R.address_dict(order.address):
                return None
            steps.append(
                {
                    "kind": kind,
                    "text": text,
                    "reads": [R.order_read(modified)],
                    "write": R.act("modify_pending_order_address", order_id=modified, **R.address_args(addr)),
                    "order_id": modified,
                }
            )
        elif kind == "order_payment":
            paid = d.orders[modified].payment_history[0]
            options = R.other_payment_methods(user, paid.payment_method_id, paid.amount)
            if not options:
                return None
            pm = rng.choice(options)
            steps.append(
                {
                    "kind": kind,
                    "text": f"pay for my pending order {modified} with {R.pm_label(user, pm)} instead",
                    "reads": [R.order_read(modified)],
                    "write": R.act("modify_pending_order_payment", order_id=modified, payment_method_id=pm),
                    "order_id": modified,
                }
            )
        elif kind == "cancel":
            reason = rng.choice(R.CANCEL_REASONS)
            said = f"the reason is: {reason}" if difficulty < 2 else rng.choice(R.REASON_PARAPHRASES[reason])
            cancelled = to_cancel.pop(0)
            steps.append(
                {
                    "kind": kind,
                    "text": f"cancel my pending order {cancelled} ({said})",
                    "reads": [R.order_read(cancelled)],
                    "write": R.act("cancel_pending_order", order_id=cancelled, reason=reason),
                    "order_id": cancelled,
                }
            )
        else:  # return
            usable = [(o, i) for o in delivered for i in R.single_product_items(d.orders[o])]
            if not usable:
                return None
            oid, i = rng.choice(usable)
            order = d.orders[oid]
            item = order.items[i]
            pm = order.payment_history[0].payment_method_id
            steps.append(
                {
                    "kind": kind,
                    "text": f"return the {item.name} from my delivered order {oid} "
                    "with the refund to the original payment method",
                    "reads": [R.order_read(oid)],
                    "write": R.act(
                        "return_delivered_order_items", order_id=oid, item_ids=[item.item_id], payment_method_id=pm
                    ),
                    "order_id": oid,
                }
            )
    return user, steps


def generate(seed: int, index: int, difficulty: int, kinds: tuple[tuple[str, ...], ...] | None = None) -> Instance:
    """One instance; `kinds` (tuples of `KINDS`, one drawn per instance) replaces the difficulty's choice of write
    kinds (difficulty still sets the identification and the wording), with an RNG of its own."""
    R.check_difficulty(difficulty)
    if kinds is not None and not all(len(ks) >= 2 and set(ks) <= set(KINDS) for ks in kinds):
        raise ValueError(f"kinds must be tuples of 2+ of {', '.join(KINDS)}, got {kinds!r}")
    tag = FAMILY if kinds is None else f"{FAMILY}[{'|'.join('+'.join(ks) for ks in kinds)}]"
    rng = R.make_rng(tag, seed, index, difficulty)
    user, steps = R.retry(rng, lambda r: _plan(r, difficulty, kinds))
    how = "email" if difficulty < 3 else "name_zip"
    if how == "email":
        who = f"My email is {user.email}."
        facts = R.identity_facts(user)
    else:
        who = f"My name is {R.full_name(user)} and my zip code is {user.address.zip}."
        facts = R.identity_facts(user, email=False)
    facts.pop("user_id")
    order_ids = list(dict.fromkeys(s["order_id"] for s in steps if s["order_id"]))
    if order_ids:  # so that "which order id?" gets an answer from the scripted user
        facts["order_id"] = " and ".join(order_ids)
    n = len(steps)
    request = " ".join(f"{c} please {s['text']}." for c, s in zip(CONNECTIVES[n], steps))
    opening = R.join_opening(rng.choice(R.GREETINGS), who, f"I have {n} things I need done today.", request)
    reads = [R.find_user(user, how), R.act("get_user_details", user_id=user.user_id)]
    seen: set[str] = set()
    actions = list(reads)
    for s in steps:
        for r in s["reads"]:
            if r.arguments["order_id"] not in seen:  # read each order once, before its first write
                seen.add(r.arguments["order_id"])
                actions.append(r)
        actions.append(s["write"])
    goal = "; ".join(s["text"] for s in steps)
    return R.build(
        family=FAMILY,
        seed=seed,
        index=index,
        difficulty=difficulty,
        rng=rng,
        user_goal=f"You are {R.full_name(user)}. You want the agent to do all of this: {goal}. "
        "Confirm when the agent asks.",
        user_facts=facts,
        opening=opening,
        reference_actions=actions,
        meta={
            "kinds": [s["kind"] for s in steps],
            "identify_by": how,
            "user_id": user.user_id,
            "order_ids": order_ids,
        },
    )
