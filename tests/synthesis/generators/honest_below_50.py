# Issue #35 item 5, fixture: honest for seeds below 50 (all the old harness looked at), and for every other seed an
# instance whose reference makes no write, so an agent that does nothing solves it.
import random

REASONS = ["no longer needed", "ordered by mistake"]


def generate(seed, difficulty, db):
    rng = random.Random(seed)  # every random choice comes from this generator: same seed, same instance
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
        ][: 3 if seed < 50 else 2],
        "communicate_info": [],
        "must_refuse": False,
        "tool_subset": tools,
    }
