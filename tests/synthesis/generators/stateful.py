# Issue #35 item 5, fixture: keeps state across calls on an imported module. Alone in a process (the harness's
# per-seed checks, training's rebuilds) every seed is its first call; in one batch (how manifests are made) the calls
# after the 50th draw from other records, so the manifest's instances differ from the rebuilds.
import random

REASONS = ["no longer needed", "ordered by mistake"]


def generate(seed, difficulty, db):
    calls = getattr(random, "generator_calls", 0)
    random.generator_calls = calls + 1
    rng = random.Random(seed if calls < 50 else seed + 7919)
    pending = sorted(oid for oid, order in db["orders"].items() if order["status"] == "pending")
    order_id = rng.choice(pending)
    order = db["orders"][order_id]
    user = db["users"][order["user_id"]]
    name = user["name"]["first_name"] + " " + user["name"]["last_name"]
    reason = rng.choice(REASONS)
    tools = ["find_user_id_by_email", "get_order_details", "cancel_pending_order", "return_delivered_order_items"]
    if difficulty >= 2:
        tools.append("modify_pending_order_items")  # one more look-alike tool to choose from
    return {
        "user_goal": f"You are {name}. You want to cancel your pending order {order_id} ({reason}).",
        "opening": f"Hi, my email is {user['email']}. Please cancel my order {order_id}, it was {reason}.",
        "user_facts": {"name": name, "email": user["email"], "zip": user["address"]["zip"], "order_id": order_id},
        "reference_actions": [
            {"name": "find_user_id_by_email", "arguments": {"email": user["email"]}},
            {"name": "get_order_details", "arguments": {"order_id": order_id}},
            {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": reason}},
        ],
        "communicate_info": [],
        "must_refuse": False,
        "tool_subset": tools,
    }
