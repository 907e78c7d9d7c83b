"""Family `single_write`: one DB write whose identifiers (user id, order id, item id, payment method id) are all
given in the opening, so the only skills tested are picking the right tool and filling its arguments.

Difficulty:
  0 — cancel a pending order; the reason is said in the policy's exact words; short opening.
  1 — cancel or change a pending order's shipping address.
  2 — also change a pending order's payment method or the user's default address; the cancel reason is
      paraphrased; one irrelevant sentence.
  3 — also return a delivered item; two irrelevant sentences and a mention of another order to leave alone.
"""

from __future__ import annotations

import random

from trace_core.envs.procedural import _retail as R
from trace_core.schemas import Instance

FAMILY = "single_write"
KINDS_BY_DIFFICULTY = {
    0: ("cancel",),
    1: ("cancel", "order_address"),
    2: ("cancel", "order_address", "order_payment", "user_address"),
    3: ("cancel", "order_address", "order_payment", "user_address", "return"),
}


def _cancel(rng: random.Random, difficulty: int):
    oid = rng.choice(R.index().by_status["pending"])
    order = R.db().orders[oid]
    reason = rng.choice(R.CANCEL_REASONS)
    # d0/d1 use the policy's exact words; from d2 the agent must map a paraphrase onto an accepted reason.
    said = f"The reason is: {reason}." if difficulty < 2 else R.sentence(rng.choice(R.REASON_PARAPHRASES[reason]))
    return {
        "user_id": order.user_id,
        "order_id": oid,
        "request": f"Please cancel my pending order {oid}. {said}",
        "goal": f"cancel your pending order {oid} (reason: {reason})",
        "actions": [R.order_read(oid), R.act("cancel_pending_order", order_id=oid, reason=reason)],
        "meta": {"reason": reason},
    }


def _order_address(rng: random.Random, difficulty: int):
    oid = rng.choice(R.index().by_status["pending"])
    order = R.db().orders[oid]
    addr = R.new_address(rng, avoid=[R.address_dict(order.address)])
    return {
        "user_id": order.user_id,
        "order_id": oid,
        "request": f"Please ship my pending order {oid} to {R.speak_address(addr)} instead.",
        "goal": f"change the shipping address of pending order {oid} to {R.speak_address(addr)}",
        "actions": [R.order_read(oid), R.act("modify_pending_order_address", order_id=oid, **R.address_args(addr))],
        "meta": {"new_address": addr},
    }


def _order_payment(rng: random.Random, difficulty: int):
    oid = rng.choice(R.index().by_status["pending"])
    order = R.db().orders[oid]
    user = R.db().users[order.user_id]
    paid = order.payment_history[0]
    options = R.other_payment_methods(user, paid.payment_method_id, paid.amount)
    if not options:
        return None
    pm = rng.choice(options)
    label = f"{R.pm_label(user, pm)} ({pm})" if difficulty >= 3 else pm
    return {
        "user_id": user.user_id,
        "order_id": oid,
        "request": f"Please switch the payment method of my pending order {oid} to {label}.",
        "goal": f"pay for pending order {oid} with {pm} instead of {paid.payment_method_id}",
        "actions": [R.order_read(oid), R.act("modify_pending_order_payment", order_id=oid, payment_method_id=pm)],
        "meta": {"payment_method_id": pm},
    }


def _user_address(rng: random.Random, difficulty: int):
    uid = rng.choice(R.index().user_ids)
    user = R.db().users[uid]
    addr = R.new_address(rng, avoid=[R.address_dict(user.address)])
    return {
        "user_id": uid,
        "order_id": None,
        "request": f"I've moved: please update my default address to {R.speak_address(addr)}.",
        "goal": f"change your default address to {R.speak_address(addr)}",
        "actions": [
            R.act("get_user_details", user_id=uid),
            R.act("modify_user_address", user_id=uid, **R.address_args(addr)),
        ],
        "meta": {"new_address": addr},
    }


def _return(rng: random.Random, difficulty: int):
    oid = rng.choice(R.index().by_status["delivered"])
    order = R.db().orders[oid]
    user = R.db().users[order.user_id]
    items = R.single_product_items(order)
    if not items:
        return None
    item = order.items[rng.choice(items)]
    refund_options = [order.payment_history[0].payment_method_id] + [
        p for p in sorted(user.payment_methods) if user.payment_methods[p].source == "gift_card"
    ]
    pm = rng.choice(sorted(set(refund_options)))
    return {
        "user_id": user.user_id,
        "order_id": oid,
        "request": (
            f"I'd like to return the {item.name} (item {item.item_id}) from my delivered order {oid}, "
            f"with the refund going to {R.pm_label(user, pm)} ({pm})."
        ),
        "goal": f"return the {item.name} (item {item.item_id}) from order {oid}, refund to {pm}",
        "actions": [
            R.order_read(oid),
            R.act("return_delivered_order_items", order_id=oid, item_ids=[item.item_id], payment_method_id=pm),
        ],
        "meta": {"item_ids": [item.item_id], "payment_method_id": pm},
    }


DRAWERS = {
    "cancel": _cancel,
    "order_address": _order_address,
    "order_payment": _order_payment,
    "user_address": _user_address,
    "return": _return,
}


def generate(seed: int, index: int, difficulty: int) -> Instance:
    R.check_difficulty(difficulty)
    rng = R.make_rng(FAMILY, seed, index, difficulty)
    kind = rng.choice(KINDS_BY_DIFFICULTY[difficulty])
    draw = R.retry(rng, lambda r: DRAWERS[kind](r, difficulty))
    user = R.db().users[draw["user_id"]]
    extra = R.fillers(rng, {0: 0, 1: 0, 2: 1, 3: 2}[difficulty])
    aside = None
    if difficulty >= 3:
        # A second order id in the opening that must not be touched: the agent has to act on the right one.
        others = [o for o in user.orders if o != draw["order_id"]]
        if others:
            aside = f"My other order {rng.choice(others)} is fine, please leave it as it is."
    greeting = rng.choice(R.GREETINGS)
    opening = R.join_opening(
        greeting, extra[0] if extra else None, f"My user id is {user.user_id}.", draw["request"], aside, *extra[1:]
    )
    facts = R.identity_facts(user)
    if draw["order_id"]:
        facts["order_id"] = draw["order_id"]
    return R.build(
        family=FAMILY,
        seed=seed,
        index=index,
        difficulty=difficulty,
        rng=rng,
        user_goal=f"You are {R.full_name(user)} (user id {user.user_id}). You want to {draw['goal']}. "
        "Confirm when the agent asks.",
        user_facts=facts,
        opening=opening,
        reference_actions=draw["actions"],
        meta={
            "kind": kind,
            "user_id": user.user_id,
            "order_id": draw["order_id"],
            "n_fillers": len(extra),
            **draw["meta"],
        },
    )
