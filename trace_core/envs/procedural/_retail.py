"""Shared helpers for the procedural retail families: the cached τ² retail DB, deterministic RNGs, addresses,
spoken descriptions of payment methods and cancel reasons, reference-action builders and the `Instance` assembly.

Every generator is a pure function of (family, seed, index, difficulty). To keep it so, everything here is
derived from the read-only DB in sorted-key order and from a `random.Random` seeded with a sha256 of those four
values (never Python's salted `hash()`), and no set is iterated without sorting it first.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trace_core.schemas import Action, Instance

DOMAIN = "retail"
MAX_DIFFICULTY = 3

# τ²'s retail tools, split by whether they change the DB (tests check this against τ²'s own annotations).
WRITE_TOOLS = frozenset(
    {
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "modify_pending_order_address",
        "modify_pending_order_items",
        "modify_pending_order_payment",
        "modify_user_address",
        "return_delivered_order_items",
    }
)
READ_TOOLS = frozenset(
    {
        "calculate",
        "find_user_id_by_email",
        "find_user_id_by_name_zip",
        "get_order_details",
        "get_product_details",
        "get_user_details",
        "list_all_product_types",
        "transfer_to_human_agents",
    }
)
ALL_TOOLS = tuple(sorted(WRITE_TOOLS | READ_TOOLS))

# Tools an agent could plausibly confuse with a needed one: distractors for the compact tool subset.
LOOKALIKES: dict[str, tuple[str, ...]] = {
    "cancel_pending_order": ("return_delivered_order_items", "modify_pending_order_items"),
    "exchange_delivered_order_items": ("return_delivered_order_items", "modify_pending_order_items"),
    "modify_pending_order_address": ("modify_user_address", "cancel_pending_order"),
    "modify_pending_order_items": ("exchange_delivered_order_items", "modify_pending_order_payment"),
    "modify_pending_order_payment": ("modify_pending_order_items", "cancel_pending_order"),
    "modify_user_address": ("modify_pending_order_address",),
    "return_delivered_order_items": ("exchange_delivered_order_items", "cancel_pending_order"),
    "find_user_id_by_email": ("find_user_id_by_name_zip",),
    "find_user_id_by_name_zip": ("find_user_id_by_email",),
    "get_order_details": ("get_user_details",),
    "get_product_details": ("list_all_product_types",),
}
GENERIC_DISTRACTORS = ("calculate", "list_all_product_types", "transfer_to_human_agents", "get_user_details")

CANCEL_REASONS = ("no longer needed", "ordered by mistake")
# How users say the two allowed reasons without the policy's exact words (the agent maps them back).
REASON_PARAPHRASES = {
    "no longer needed": ("I don't need it anymore", "it turns out I won't need it", "I have no use for it now"),
    "ordered by mistake": ("I ordered it by mistake", "I placed it by accident", "I clicked order by mistake"),
}
# Reasons the policy does not accept (policy_refusal): an agent must not map them onto an allowed one.
BAD_REASONS = (
    "I found a cheaper price at another store",
    "the delivery estimate is too slow for me",
    "I want to reorder it later with a coupon",
    "the seller's reviews made me nervous",
    "I'd rather pay for it next month",
)

GREETINGS = ("Hi.", "Hello!", "Hi there.", "Good morning.", "Hey!")

# Irrelevant details that lengthen openings at higher difficulty; none contains an identifier or a request.
FILLERS = (
    "I've been shopping with you for a few years now.",
    "Sorry if this is a bit rushed, I'm on my lunch break.",
    "My neighbour recommended your store to me originally.",
    "The weather here has been terrible all week, so I'm catching up on errands.",
    "I tried the website first but couldn't figure it out.",
    "Last time I called, the agent was really helpful.",
    "I'm writing from my phone, so apologies for any typos.",
    "We just moved our office around, which is why everything is a mess.",
)


# -- the database ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def db():
    """The real τ² retail DB, loaded once per process. Read-only: generators must never mutate it."""
    from trace_core.envs.tau2_env import _db_copy

    return _db_copy(DOMAIN)


@dataclass(frozen=True)
class Index:
    """Sorted views of the DB that every family draws from."""

    user_ids: tuple[str, ...]
    order_ids: tuple[str, ...]
    by_status: dict[str, tuple[str, ...]]
    places: tuple[tuple[str, str, str], ...]  # (city, state, zip) seen in user addresses
    streets: tuple[str, ...]

    def orders_of(self, user_id: str, status: str | None = None) -> list[str]:
        """The user's order ids in the DB's order (stable), optionally only those with `status`."""
        orders = db().orders
        return [o for o in db().users[user_id].orders if status is None or orders[o].status == status]


@functools.lru_cache(maxsize=1)
def index() -> Index:
    d = db()
    by_status: dict[str, list[str]] = {}
    for oid in sorted(d.orders):
        by_status.setdefault(d.orders[oid].status, []).append(oid)
    addresses = [d.users[u].address for u in sorted(d.users)]
    return Index(
        user_ids=tuple(sorted(d.users)),
        order_ids=tuple(sorted(d.orders)),
        by_status={k: tuple(v) for k, v in sorted(by_status.items())},
        places=tuple(sorted({(a.city, a.state, a.zip) for a in addresses})),
        streets=tuple(sorted({re.sub(r"^\d+\s+", "", a.address1) for a in addresses})),
    )


# -- determinism -------------------------------------------------------------------------------------------
def check_difficulty(difficulty: int) -> int:
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be an integer in 0..{MAX_DIFFICULTY}, got {difficulty!r}")
    return difficulty


def make_rng(family: str, seed: int, index: int, difficulty: int) -> random.Random:
    """A generator private to one instance, derived from a sha256 of its coordinates (stable across runs)."""
    key = f"trace/procedural/{DOMAIN}/{family}/seed={int(seed)}/index={int(index)}/d={int(difficulty)}"
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big"))


class NoCandidate(RuntimeError):
    """A draw found nothing suitable (should not happen on the real DB; generators retry with fresh draws)."""


def retry(rng: random.Random, draw, attempts: int = 5000):
    """Call `draw(rng)` until it returns something other than None; the retries consume the same RNG."""
    for _ in range(attempts):
        out = draw(rng)
        if out is not None:
            return out
    raise NoCandidate("no suitable records found in the retail DB")


# -- people and addresses ----------------------------------------------------------------------------------
def full_name(user) -> str:
    return f"{user.name.first_name} {user.name.last_name}"


def identity_facts(user, *, email: bool = True) -> dict[str, str]:
    """What a user knows about themselves. `email=False` plays a user who forgot their e-mail."""
    facts = {"name": full_name(user), "zip": user.address.zip, "user_id": user.user_id}
    if email:
        facts["email"] = user.email
    return facts


def address_dict(addr) -> dict[str, str]:
    return {k: getattr(addr, k) for k in ("address1", "address2", "city", "state", "country", "zip")}


def new_address(rng: random.Random, avoid: Iterable[dict[str, str]] = ()) -> dict[str, str]:
    """A plausible US address (city/state/zip taken together from the DB) that differs from every `avoid`."""
    avoid = list(avoid)
    ix = index()
    while True:
        city, state, zip_code = rng.choice(ix.places)
        street = rng.choice(ix.streets)
        number = rng.randint(10, 9999)
        suite = rng.randint(100, 999)
        address2 = f"Suite {suite}" if rng.random() < 0.5 else ""
        addr = {
            "address1": f"{number} {street}",
            "address2": address2,
            "city": city,
            "state": state,
            "country": "USA",
            "zip": zip_code,
        }
        if all(addr != a for a in avoid):
            return addr


def speak_address(addr: dict[str, str]) -> str:
    """An address as a user says it; every field is stated so the agent can fill the tool's arguments."""
    if addr["address2"]:
        return (
            f"{addr['address1']}, {addr['address2']}, {addr['city']}, {addr['state']} {addr['zip']}, {addr['country']}"
        )
    return (
        f"{addr['address1']}, {addr['city']}, {addr['state']} {addr['zip']}, {addr['country']} "
        "(there is no second address line)"
    )


# -- payment methods ---------------------------------------------------------------------------------------
def pm_label(user, pm_id: str) -> str:
    """A spoken name that singles out one of the user's payment methods (unique within the user)."""
    pm = user.payment_methods[pm_id]
    same = [p for p in sorted(user.payment_methods) if user.payment_methods[p].source == pm.source]
    if pm.source == "paypal":
        return "my PayPal account" if len(same) == 1 else f"my PayPal account {pm_id}"
    if pm.source == "gift_card":
        return "my gift card" if len(same) == 1 else f"my gift card {pm_id}"
    return f"my {pm.brand} credit card ending in {pm.last_four}"


def pm_can_pay(user, pm_id: str, amount: float) -> bool:
    """Whether `pm_id` can cover `amount` (only gift cards have a balance to check)."""
    pm = user.payment_methods[pm_id]
    return pm.source != "gift_card" or pm.balance >= amount


def other_payment_methods(user, exclude: str, amount: float) -> list[str]:
    """The user's payment methods other than `exclude` that can pay `amount`, sorted."""
    return [p for p in sorted(user.payment_methods) if p != exclude and pm_can_pay(user, p, amount)]


# -- orders, items, variants -------------------------------------------------------------------------------
def single_product_items(order) -> list[int]:
    """Indices of items whose product occurs once in the order, so "the <product>" names exactly one item."""
    counts: dict[str, int] = {}
    for it in order.items:
        counts[it.product_id] = counts.get(it.product_id, 0) + 1
    return [i for i, it in enumerate(order.items) if counts[it.product_id] == 1]


def speak_options(options: dict[str, str]) -> str:
    parts = [f"{k}: {v}" for k, v in options.items()]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass(frozen=True)
class VariantPick:
    target_id: str
    constraints: dict[str, str]  # option name -> wanted value, in the product's option order
    distractors: int  # available candidates that share at least one constrained value with the target
    unavailable_matches: int  # out-of-stock variants that also satisfy every constraint


def pick_variant(
    rng: random.Random, item, n_constraints: int, *, minimal: bool, keep_one: bool = False
) -> VariantPick | None:
    """Choose another available variant of `item`'s product and `n_constraints` option values that single it out.

    The constraints must match exactly one available variant other than the current item (so the right new
    item is derivable from get_product_details), must not all hold for the current item (the user asks for a
    change), and with `minimal` every constraint is needed: dropping any one leaves several candidates. With
    `keep_one`, at least one constraint keeps the current item's value (the user can say "the same <option>").
    """
    product = db().products[item.product_id]
    variants = [product.variants[v] for v in sorted(product.variants)]
    candidates = [v for v in variants if v.available and v.item_id != item.item_id]
    option_names = list(variants[0].options)
    if not candidates or n_constraints > len(option_names):
        return None

    def fits(v, cons: dict[str, str]) -> bool:
        return all(v.options.get(k) == val for k, val in cons.items())

    def n_matching(cons: dict[str, str]) -> int:
        return sum(fits(v, cons) for v in candidates)

    targets = list(candidates)
    rng.shuffle(targets)
    subsets = list(itertools.combinations(option_names, n_constraints))
    for target in targets:
        order = list(subsets)
        rng.shuffle(order)
        for names in order:
            cons = {n: target.options[n] for n in names}
            if n_matching(cons) != 1 or fits(item, cons):  # target fits by construction
                continue
            if keep_one and not any(item.options.get(k) == val for k, val in cons.items()):
                continue
            redundant = minimal and any(
                n_matching({k: v for k, v in cons.items() if k != drop}) < 2 for drop in names if n_constraints > 1
            )
            if redundant:  # with `minimal`, dropping any constraint must leave several candidates
                continue
            shared = sum(
                1 for v in candidates if v is not target and any(v.options.get(k) == val for k, val in cons.items())
            )
            unavailable = sum(1 for v in variants if not v.available and v.item_id != item.item_id and fits(v, cons))
            return VariantPick(target.item_id, cons, shared, unavailable)
    return None


# -- reference actions -------------------------------------------------------------------------------------
def act(name: str, **arguments: Any) -> Action:
    return Action(name=name, arguments=arguments)


def find_user(user, how: str) -> Action:
    if how == "email":
        return act("find_user_id_by_email", email=user.email)
    return act(
        "find_user_id_by_name_zip", first_name=user.name.first_name, last_name=user.name.last_name, zip=user.address.zip
    )


def order_read(order_id: str) -> Action:
    return act("get_order_details", order_id=order_id)


def address_args(addr: dict[str, str]) -> dict[str, str]:
    return {k: addr[k] for k in ("address1", "address2", "city", "state", "country", "zip")}


# -- text --------------------------------------------------------------------------------------------------
def fillers(rng: random.Random, n: int) -> list[str]:
    return rng.sample(FILLERS, n) if n else []


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", "!", "?")) else ".")


def join_opening(*parts: str | None) -> str:
    return " ".join(p.strip() for p in parts if p and p.strip())


# -- assembly ----------------------------------------------------------------------------------------------
def tool_subset(rng: random.Random, needed: Iterable[str], n_distractors: int) -> tuple[list[str], list[str]]:
    """The compact profile's tools for an instance: the needed ones plus `n_distractors` plausible look-alikes."""
    need = set(needed)
    pool = sorted({t for n in need for t in LOOKALIKES.get(n, ())} - need)
    if len(pool) < n_distractors:
        pool += sorted(set(GENERIC_DISTRACTORS) - need - set(pool))
    distractors = sorted(rng.sample(pool, min(n_distractors, len(pool))))
    return sorted(need | set(distractors)), distractors


def build(
    *,
    family: str,
    seed: int,
    index: int,
    difficulty: int,
    rng: random.Random,
    user_goal: str,
    user_facts: dict[str, str],
    opening: str,
    reference_actions: list[Action],
    must_refuse: bool = False,
    extra_tools: Iterable[str] = (),
    communicate_info: list[str] | None = None,
    meta: dict[str, Any] | None = None,
) -> Instance:
    """Assemble an Instance; the tool subset is every tool the reference uses (plus `extra_tools`) and distractors."""
    writes = [a for a in reference_actions if a.name in WRITE_TOOLS]
    if must_refuse and writes:
        raise AssertionError("a refusal instance must not have reference writes")
    info = list(communicate_info or [])
    if any("," in x for x in info):
        raise AssertionError("communicate_info must not contain commas (τ² strips them from messages)")
    needed = [a.name for a in reference_actions] + list(extra_tools)
    subset, distractors = tool_subset(rng, needed, 1 if difficulty < 2 else 2)
    return Instance(
        instance_id=f"proc/{DOMAIN}/{family}/d{difficulty}/s{seed}/{index}",
        source="procedural",
        domain=DOMAIN,
        family=family,
        seed=seed,
        index=index,
        difficulty=difficulty,
        user_goal=user_goal,
        user_facts=user_facts,
        opening=opening,
        reference_actions=reference_actions,
        communicate_info=info,
        requires_write=bool(writes),
        must_refuse=must_refuse,
        tool_subset=subset,
        meta={**(meta or {}), "distractor_tools": distractors, "n_writes": len(writes)},
    )
