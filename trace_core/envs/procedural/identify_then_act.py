"""Family `identify_then_act`: the user gives no user id, so the agent must first find it (by e-mail or by
name + zip) and then act on the account.

Difficulty:
  0 — the user gives their e-mail and the order id; change the default address, change an order's address or
      payment method (named as "my PayPal account" etc., so the user's details must be read), or cancel.
  1 — as 0, but the user forgot their e-mail and gives name + zip (find_user_id_by_name_zip).
  2 — name + zip and no order id: "my pending order with the <product>", where that product is in exactly one
      of the user's orders; the agent must read the user's details and their orders to find it.
  3 — as 2, but the product is in several of the user's orders and only one of them is pending.
"""

from __future__ import annotations

import random

from trace_core.envs.procedural import _retail as R
from trace_core.schemas import Instance

FAMILY = "identify_then_act"
ORDER_KINDS = ("cancel", "order_address", "order_payment")


def _pick_target(rng: random.Random, difficulty: int, kind: str):
    """(user, order id or None, product name or None) for this difficulty, or None to redraw."""
    ix = R.index()
    d = R.db()
    if kind == "user_address":
        return d.users[rng.choice(ix.user_ids)], None, None
    if difficulty < 2:
        oid = rng.choice(ix.by_status["pending"])
        return d.users[d.orders[oid].user_id], oid, None
    oid = rng.choice(ix.by_status["pending"])
    order = d.orders[oid]
    user = d.users[order.user_id]
    # The products of this order that single it out among the user's orders the way this difficulty needs.
    usable = []
    for pid in sorted({it.product_id for it in order.items}):
        holders = [o for o in user.orders if any(it.product_id == pid for it in d.orders[o].items)]
        pending_holders = [o for o in holders if d.orders[o].status == "pending"]
        if pending_holders != [oid]:
            continue
        if (difficulty == 2 and holders == [oid]) or (difficulty == 3 and len(holders) >= 2):
            usable.append(pid)
    if not usable:
        return None
    pid = rng.choice(usable)
    name = next(it.name for it in order.items if it.product_id == pid)
    return user, oid, name


def _draw(rng: random.Random, difficulty: int, kind: str):
    picked = _pick_target(rng, difficulty, kind)
    if picked is None:
        return None
    user, oid, product = picked
    d = R.db()
    if oid is None:
        ref = "the order"
    elif product is None:
        ref = f"my order {oid}"
    elif difficulty == 2:
        ref = f"my pending order with the {product} in it"
    else:
        ref = f"my order with the {product} in it, the one that is still pending (not the other ones)"

    # The user's own words for the order: its id only when they know it (an LLM user must not leak it).
    goal_ref = f"order {oid}" if product is None else f"your pending order that contains the {product}"
    if kind == "user_address":
        addr = R.new_address(rng, avoid=[R.address_dict(user.address)])
        request = f"I need to update the default address on my account to {R.speak_address(addr)}."
        goal = f"change your default address to {R.speak_address(addr)}"
        writes = [R.act("modify_user_address", user_id=user.user_id, **R.address_args(addr))]
        meta = {"new_address": addr}
    elif kind == "cancel":
        reason = rng.choice(R.CANCEL_REASONS)
        request = f"Please cancel {ref}; the reason is: {reason}."
        goal = f"cancel {goal_ref} (reason: {reason})"
        writes = [R.act("cancel_pending_order", order_id=oid, reason=reason)]
        meta = {"reason": reason}
    elif kind == "order_address":
        addr = R.new_address(rng, avoid=[R.address_dict(d.orders[oid].address)])
        request = f"Please change the shipping address of {ref} to {R.speak_address(addr)}."
        goal = f"ship {goal_ref} to {R.speak_address(addr)}"
        writes = [R.act("modify_pending_order_address", order_id=oid, **R.address_args(addr))]
        meta = {"new_address": addr}
    else:  # order_payment: the method is named the way a user would, so the agent must read the user's details
        paid = d.orders[oid].payment_history[0]
        options = R.other_payment_methods(user, paid.payment_method_id, paid.amount)
        if not options:
            return None
        pm = rng.choice(options)
        request = f"I'd like to pay for {ref} with {R.pm_label(user, pm)} instead."
        goal = f"pay for {goal_ref} with {R.pm_label(user, pm)}"
        writes = [R.act("modify_pending_order_payment", order_id=oid, payment_method_id=pm)]
        meta = {"payment_method_id": pm}
    return user, oid, product, request, goal, writes, meta


def generate(seed: int, index: int, difficulty: int) -> Instance:
    R.check_difficulty(difficulty)
    rng = R.make_rng(FAMILY, seed, index, difficulty)
    # The kind is drawn once, before any retry, so that rarely-feasible kinds keep their share.
    kind = rng.choice(ORDER_KINDS + ("user_address",) if difficulty < 2 else ORDER_KINDS)
    user, oid, product, request, goal, writes, meta = R.retry(rng, lambda r: _draw(r, difficulty, kind))
    how = "email" if difficulty == 0 else "name_zip"
    if how == "email":
        who = f"My email is {user.email}."
        facts = R.identity_facts(user)
    else:
        who = (
            f"I can't remember which email I used, but my name is {R.full_name(user)} "
            f"and my zip code is {user.address.zip}."
        )
        facts = R.identity_facts(user, email=False)
    facts.pop("user_id")  # the point of the family: the user does not know their user id
    if oid is not None and product is None:
        facts["order_id"] = oid

    reads = [R.find_user(user, how)]
    if kind in ("user_address", "order_payment") or product is not None:
        reads.append(R.act("get_user_details", user_id=user.user_id))
    if oid is not None:
        if product is None:
            reads.append(R.order_read(oid))
        else:
            # Without an order id the agent reads the user's orders until it finds the one described.
            for o in user.orders[: user.orders.index(oid) + 1]:
                reads.append(R.order_read(o))
    opening = R.join_opening(rng.choice(R.GREETINGS), who, request)
    return R.build(
        family=FAMILY,
        seed=seed,
        index=index,
        difficulty=difficulty,
        rng=rng,
        user_goal=f"You are {R.full_name(user)}. You want to {goal}. "
        + ("You do not know the order id. " if product else "")
        + "Confirm when the agent asks.",
        user_facts=facts,
        opening=opening,
        reference_actions=reads + writes,
        meta={
            "kind": kind,
            "identify_by": how,
            "user_id": user.user_id,
            "order_id": oid,
            "product_hint": product,
            **meta,
        },
    )
