"""Generated DB states for the retail templates: each instance's customer becomes a new account of its own.

A template draws its problem (orders, items, statuses, policy rule) from the real τ² retail database, which holds
500 customers; over a thousand seeds the same customer and order come back and reference solutions repeat (the
harness measured 76-88% distinct at 1,000 seeds). `fresh_customer` gives the instance a customer who is not in
the stock database: a new user id, name and e-mail, and copies of that customer's orders under new order ids,
added to the database by the instance's `db_patch` (τ² `agent_data`, which the environment applies before the
episode and τ²'s evaluator before its replays). Everything the problem is made of — items, prices, statuses,
payment methods, addresses — stays the real data; only who it belongs to is new, so the agent cannot succeed by
recalling a customer it has seen before, and every seed asks for its own tool arguments.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re

from trace_core.envs.procedural._retail import db
from trace_core.schemas import Instance

_ORDER_ID = re.compile(r"#?W(\d{7})\b")


@functools.lru_cache(maxsize=1)
def _names() -> tuple[tuple[str, ...], tuple[str, ...], frozenset[tuple[str, str, str]]]:
    users = db().users
    firsts = tuple(sorted({u.name.first_name for u in users.values()}))
    lasts = tuple(sorted({u.name.last_name for u in users.values()}))
    taken = frozenset((u.name.first_name, u.name.last_name, u.address.zip) for u in users.values())
    return firsts, lasts, taken


@functools.lru_cache(maxsize=1)
def _lookup() -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    users = db().users
    by_email = {u.email: uid for uid, u in sorted(users.items())}
    by_name_zip: dict[tuple[str, str], str] = {}
    for uid, u in sorted(users.items()):
        by_name_zip.setdefault((f"{u.name.first_name} {u.name.last_name}", u.address.zip), uid)
    return by_email, by_name_zip


@functools.lru_cache(maxsize=1)
def _stock_order_digits() -> frozenset[str]:
    return frozenset(oid[2:] for oid in db().orders)


def customer_of(inst: Instance) -> str | None:
    """The stock user id of the customer an instance plays (from what the user knows about themselves)."""
    facts = inst.user_facts
    by_email, by_name_zip = _lookup()
    if facts.get("user_id") in db().users:
        return facts["user_id"]
    if facts.get("email") in by_email:
        return by_email[facts["email"]]
    return by_name_zip.get((facts.get("name", ""), facts.get("zip", "")))


def customer_rng(template: str, seed: int, difficulty: int) -> random.Random:
    key = f"trace/synthesis/customer/{template}/seed={int(seed)}/d={int(difficulty)}"
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big"))


def fresh_customer(inst: Instance, rng: random.Random) -> Instance:
    """`inst` with its customer (`customer_of`) replaced by a new account holding copies of the same orders.
    Instances without a known customer are returned unchanged."""
    d = db()
    old_id = customer_of(inst)
    if old_id is None:
        return inst
    user = d.users[old_id]
    firsts, lasts, taken = _names()
    zip_code = user.address.zip
    while True:  # a name nobody at this zip has, so that a lookup by name and zip finds only the new account
        first, last = rng.choice(firsts), rng.choice(lasts)
        if (first, last) != (user.name.first_name, user.name.last_name) and (first, last, zip_code) not in taken:
            break
    while True:
        new_id = f"{first.lower()}_{last.lower()}_{rng.randint(1000, 9999)}"
        email = f"{first.lower()}.{last.lower()}{rng.randint(1000, 9999)}@example.com"
        if new_id not in d.users and email not in _lookup()[0]:
            break
    order_map: dict[str, str] = {}  # old 7 digits -> new 7 digits
    used = set(_stock_order_digits())
    for oid in user.orders:
        while True:
            digits = str(rng.randint(1_000_000, 9_999_999))
            if digits not in used:
                used.add(digits)
                order_map[oid[2:]] = digits
                break

    new_user = user.model_dump(mode="json")
    new_user.update(
        user_id=new_id,
        name={"first_name": first, "last_name": last},
        email=email,
        orders=[f"#W{order_map[o[2:]]}" for o in user.orders],
    )
    new_orders = {}
    for oid in user.orders:
        order = d.orders[oid].model_dump(mode="json")
        order.update(order_id=f"#W{order_map[oid[2:]]}", user_id=new_id)
        new_orders[order["order_id"]] = order

    old_name = f"{user.name.first_name} {user.name.last_name}"
    words = {user.name.first_name: first, user.name.last_name: last}

    def text(s: str) -> str:
        s = s.replace(old_id, new_id).replace(user.email, email).replace(old_name, f"{first} {last}")
        return _ORDER_ID.sub(lambda m: m.group(0).replace(m.group(1), order_map.get(m.group(1), m.group(1))), s)

    def value(v):
        # Tool arguments that are exactly a first or last name (find_user_id_by_name_zip) change with the name.
        if isinstance(v, str):
            return words.get(v, text(v))
        if isinstance(v, list):
            return [value(x) for x in v]
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return v

    data = inst.model_dump(mode="json")
    for key in ("user_goal", "opening"):
        if data[key] is not None:
            data[key] = text(data[key])
    data["user_facts"] = value(data["user_facts"])
    data["communicate_info"] = [text(x) for x in data["communicate_info"]]
    data["reference_actions"] = value(data["reference_actions"])
    data["meta"] = value(data["meta"])
    patch = dict(inst.db_patch or {})
    patch["users"] = {**patch.get("users", {}), new_id: new_user}
    patch["orders"] = {**patch.get("orders", {}), **new_orders}
    data["db_patch"] = patch
    out = Instance.model_validate(data)
    # Nothing of the old identity may survive outside the patch (it would point the agent at the stock account).
    leftover = json.dumps(out.model_dump(mode="json", exclude={"db_patch"}))
    for old in (old_id, user.email, *(f"W{o[2:]}" for o in user.orders)):
        if old in leftover:
            raise AssertionError(f"{inst.instance_id}: {old!r} still appears after the customer was replaced")
    return out
