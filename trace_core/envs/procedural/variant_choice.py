"""Family `variant_choice`: exchange a delivered item (exchange_delivered_order_items) or change a pending
order's item (modify_pending_order_items) to the one available variant of the same product that matches the
option constraints the user states; other variants share some of those options (distractors).

Difficulty:
  0 — 1 constraint; no out-of-stock variant matches it; pay any difference with the original payment method.
  1 — 2 constraints, each needed (either one alone matches several available variants); no out-of-stock match.
  2 — 3 constraints, each needed (or 2 when the product has only 2 options); an order with 2+ items; out-of-stock
      variants may match too; the payment method for the difference is named ("my PayPal account") and may
      differ from the original.
  3 — as 2 with 3 constraints, an order with 3+ items, at least 3 distractor variants, and at least one
      constraint said relative to the current item ("the same color as the one I have"), so the agent must
      read the ordered item's options as well as the product's variants.
"""

from __future__ import annotations

import random

from trace_core.envs.procedural import _retail as R
from trace_core.schemas import Instance

FAMILY = "variant_choice"
N_CONSTRAINTS = {0: 1, 1: 2, 2: 3, 3: 3}
MIN_ITEMS = {0: 1, 1: 1, 2: 2, 3: 3}


def _draw(rng: random.Random, difficulty: int):
    ix = R.index()
    d = R.db()
    status = rng.choice(("delivered", "pending"))
    oid = rng.choice(ix.by_status[status])
    order = d.orders[oid]
    if len(order.items) < MIN_ITEMS[difficulty]:
        return None
    candidates = R.single_product_items(order)
    if not candidates:
        return None
    item = order.items[rng.choice(candidates)]
    n_options = len(item.options)
    k = N_CONSTRAINTS[difficulty]
    if difficulty == 2:
        k = min(k, n_options)  # a 2-option product still counts at d2 with both options constrained
    pick = R.pick_variant(rng, item, k, minimal=difficulty >= 1, keep_one=difficulty == 3)
    if pick is None:
        return None
    if difficulty < 2 and pick.unavailable_matches:
        return None
    if difficulty == 3 and pick.distractors < 3:
        return None
    user = d.users[order.user_id]
    new_price = d.products[item.product_id].variants[pick.target_id].price
    diff = round(new_price - item.price, 2)
    original = order.payment_history[0].payment_method_id
    if difficulty < 2:
        pm = original
        pay_text = "Please use the original payment method of the order for any price difference."
    else:
        pm = rng.choice(sorted(user.payment_methods))
        pay_text = f"Any price difference should go through {R.pm_label(user, pm)}."
    if not R.pm_can_pay(user, pm, diff):
        return None
    return user, order, item, pick, pm, pay_text, diff


def generate(seed: int, index: int, difficulty: int) -> Instance:
    R.check_difficulty(difficulty)
    rng = R.make_rng(FAMILY, seed, index, difficulty)
    user, order, item, pick, pm, pay_text, diff = R.retry(rng, lambda r: _draw(r, difficulty))
    oid = order.order_id
    if difficulty == 3:
        # Options that keep the current value are said relative to the item the user has.
        said = {k: v for k, v in pick.constraints.items() if item.options.get(k) != v}
        kept = [k for k, v in pick.constraints.items() if item.options.get(k) == v]
        wanted = R.speak_options(said) + ", keeping the same " + " and ".join(kept) + " as the one I have"
    else:
        kept = []
        wanted = R.speak_options(pick.constraints)
    if order.status == "delivered":
        tool = "exchange_delivered_order_items"
        request = f"I received my order {oid} and would like to exchange the {item.name} for the version with {wanted}."
        goal = f"exchange the {item.name} in delivered order {oid} for the available variant with {wanted}"
    else:
        tool = "modify_pending_order_items"
        request = f"In my pending order {oid}, please change the {item.name} to the version with {wanted}."
        goal = f"change the {item.name} in pending order {oid} to the available variant with {wanted}"
    opening = R.join_opening(
        rng.choice(R.GREETINGS),
        f"My email is {user.email}.",
        request,
        pay_text,
        "That's the only item I want to change.",
    )
    reads = [R.find_user(user, "email"), R.order_read(oid), R.act("get_product_details", product_id=item.product_id)]
    if difficulty >= 2:
        reads.append(R.act("get_user_details", user_id=user.user_id))  # the named payment method's id
    write = R.act(tool, order_id=oid, item_ids=[item.item_id], new_item_ids=[pick.target_id], payment_method_id=pm)
    facts = R.identity_facts(user)
    facts.pop("user_id")
    facts["order_id"] = oid
    return R.build(
        family=FAMILY,
        seed=seed,
        index=index,
        difficulty=difficulty,
        rng=rng,
        user_goal=f"You are {R.full_name(user)}. You want to {goal}. {pay_text} "
        "Confirm when the agent asks; this is the only item to change.",
        user_facts=facts,
        opening=opening,
        reference_actions=reads + [write],
        meta={
            "kind": "exchange" if order.status == "delivered" else "modify_items",
            "user_id": user.user_id,
            "order_id": oid,
            "item_id": item.item_id,
            "product_id": item.product_id,
            "new_item_id": pick.target_id,
            "constraints": pick.constraints,
            "n_constraints": len(pick.constraints),
            "relative_constraints": kept,
            "n_distractor_variants": pick.distractors,
            "n_unavailable_matches": pick.unavailable_matches,
            "order_items": len(order.items),
            "payment_method_id": pm,
            "price_difference": diff,
        },
    )
