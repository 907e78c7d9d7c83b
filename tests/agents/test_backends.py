"""Policy backends: LocalPolicy on a tiny random Llama (self-made byte-level tokenizer, TRL's Qwen2.5 template),
OpenAIPolicy against a real HTTP server on 127.0.0.1, the chat rendering round trip, and the factories."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trace_core.agents.chat import render_assistant, render_prompt, to_hf_messages, to_openai_messages
from trace_core.agents.factories import make_policy, sampling_from_params
from trace_core.agents.local import LocalPolicy
from trace_core.agents.openai_client import OpenAIPolicy
from trace_core.agents.parsing import parse_assistant
from trace_core.agents.policy import PolicyError
from trace_core.config import load_params
from trace_core.schemas import Message, ToolCall
from tests.defaults import completer, default_sampling, local_policy, openai_policy

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "cancel_pending_order",
            "description": "Cancel a pending order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "reason": {"type": "string"}},
                "required": ["order_id", "reason"],
            },
        },
    }
]
SYSTEM = Message(role="system", content="You are a retail agent. Follow the policy.")


def convo(i: int, extra: int = 0) -> list[Message]:
    words = " ".join(["please"] * extra)
    return [SYSTEM, Message(role="user", content=f"Cancel order #W{100 + i} {words}, I changed my mind.")]


# ---- a tiny tokenizer + model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    return local_policy(tiny_model, tokenizer, batch_size=4, max_context=400, threads=1)


# ---- chat rendering ------------------------------------------------------------------------------------------


def test_render_assistant_matches_the_template_and_parses_back(tokenizer):
    turns = [
        Message(
            role="assistant",
            tool_calls=[ToolCall(name="cancel_pending_order", arguments={"order_id": "#W1", "reason": "é ü"})],
        ),
        Message(
            role="assistant",
            content="Checking.",
            tool_calls=[ToolCall(name="a", arguments={}), ToolCall(name="b", arguments={"n": [1, {"x": None}]})],
        ),
        Message(role="assistant", content="Your order is cancelled."),
    ]
    for m in turns:
        ours = render_assistant(m)
        assert ours == render_assistant(m, tokenizer=tokenizer)
        assert ours.endswith("<|im_end|>")
        back = parse_assistant(ours)
        assert [(c.name, c.arguments) for c in back.tool_calls or []] == [
            (c.name, c.arguments) for c in m.tool_calls or []
        ]
        assert back.content == m.content
    # render_assistant accepts a list of calls plus content, too
    assert render_assistant(turns[1].tool_calls, content="Checking.") == render_assistant(turns[1])


def test_conversation_render_round_trip(tokenizer):
    """The prompt for turn k+1 = prompt for turn k + the assistant text + the template's next turns: what the model
    should produce at turn k is exactly render_assistant(turn k), and it parses back to the same calls."""
    call = ToolCall(
        id="call_0", name="cancel_pending_order", arguments={"order_id": "#W7", "reason": "ordered by mistake"}
    )
    history = convo(7)
    prompt = render_prompt(tokenizer, history, TOOLS)
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    turn = Message(role="assistant", tool_calls=[call])
    after = history + [
        turn,
        Message(role="tool", content='{"status": "cancelled"}', tool_call_id="call_0", name="cancel_pending_order"),
    ]
    prompt2 = render_prompt(tokenizer, after, TOOLS)
    text = render_assistant(turn)
    assert prompt2.startswith(prompt + text)
    assert '<tool_response>\n{"status": "cancelled"}\n</tool_response>' in prompt2
    parsed = parse_assistant(text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(call.name, call.arguments)]
    # a local turn with raw text is written back verbatim (prefer_raw), a structured one is re-rendered
    raw_turn = parse_assistant("I will cancel it <tool_call>{bad json</tool_call>")
    raw_turn.token_ids = [1, 2]
    prompt3 = render_prompt(tokenizer, history + [raw_turn], TOOLS)
    assert "I will cancel it <tool_call>{bad json</tool_call><|im_end|>" in prompt3


def test_message_format_conversions():
    msgs = [
        SYSTEM,
        Message(role="user", content="hi"),
        Message(
            role="assistant",
            content=None,
            tool_calls=[ToolCall(id="c1", name="f", arguments={"a": "é"}), ToolCall(name="g")],
        ),
        Message(role="tool", content="R1", tool_call_id="c1", name="f"),
        Message(role="tool", content="R2", name="g"),
        Message(role="assistant", content=None),
    ]
    hf = to_hf_messages(msgs)
    assert hf[2]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": {"a": "é"}},
    }
    assert hf[3] == {"role": "tool", "content": "R1", "tool_call_id": "c1", "name": "f"}
    assert hf[5]["content"] == ""
    oa = to_openai_messages(msgs)
    assert oa[2]["tool_calls"][0]["function"]["arguments"] == '{"a": "é"}'
    assert oa[2]["tool_calls"][1]["id"] == "call_2_1"
    assert oa[3]["tool_call_id"] == "c1" and oa[4]["tool_call_id"] == "call_2_1"


# ---- LocalPolicy -----------------------------------------------------------------------------------------------


def _teacher_forced_logprobs(model, prompt_ids, gen_ids):
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(gen_ids)[:, None])[:, 0].tolist()


def test_greedy_batched_equals_one_at_a_time_and_logprobs_are_exact(policy, tokenizer, tiny_model):
    reqs = [(convo(i, extra=3 * i), TOOLS) for i in range(6)]  # different lengths: left padding, 2 chunks
    s = default_sampling(temperature=0.0, max_new_tokens=12)
    batched = policy.generate(reqs, s)
    single = [policy.generate([r], s)[0] for r in reqs]
    for b, o in zip(batched, single):
        assert b.token_ids == o.token_ids and b.raw == o.raw
        assert len(b.token_ids) == len(b.logprobs) == 12
        assert b.logprobs == pytest.approx(o.logprobs, abs=1e-4)
    # logprobs equal a plain teacher-forced forward pass (checks positions and masks under left padding)
    for (msgs, tools), b in zip(reqs, batched):
        prompt_ids = tokenizer(render_prompt(tokenizer, msgs, tools), add_special_tokens=False)["input_ids"]
        assert b.logprobs == pytest.approx(_teacher_forced_logprobs(tiny_model, prompt_ids, b.token_ids), abs=1e-4)
        assert all(lp <= 0 for lp in b.logprobs)


def test_stop_token_ends_rows_at_different_steps(policy):
    reqs = [(convo(i, extra=i), TOOLS) for i in range(5)]
    s = default_sampling(max_new_tokens=10)
    free = policy.generate(reqs, s)
    # make a token that some rows produce early a stop token: rows finish at different steps, the batch shrinks
    stop = free[0].token_ids[2]
    saved = policy.stop_ids
    policy.stop_ids = saved | {stop}
    try:
        batched = policy.generate(reqs, s)
        single = [policy.generate([r], s)[0] for r in reqs]
    finally:
        policy.stop_ids = saved
    assert len(batched[0].token_ids) == 3 and batched[0].token_ids[-1] == stop
    lengths = set()
    for f, b, o in zip(free, batched, single):
        assert b.token_ids == o.token_ids
        n = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert b.token_ids == f.token_ids[:n] and len(b.logprobs) == n
        assert b.logprobs == pytest.approx(f.logprobs[:n], abs=1e-4)
        lengths.add(n)
    assert len(lengths) > 1  # rows really finished at different steps
    assert len(batched[0].raw) < len(free[0].raw)  # the stop token is not part of the text


def test_sampling_is_seeded_and_batch_independent(policy):
    reqs = [(convo(i), TOOLS) for i in range(4)]
    s = default_sampling(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=5)
    a = policy.generate(reqs, s)
    b = policy.generate(reqs, s)
    assert [m.token_ids for m in a] == [m.token_ids for m in b]
    # request i samples with seed + i whatever shares its batch
    alone = policy.generate([reqs[2]], default_sampling(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7))[0]
    assert alone.token_ids == a[2].token_ids
    c = policy.generate(reqs, default_sampling(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=6))
    assert [m.token_ids for m in c] != [m.token_ids for m in a]
    for m in a:
        assert len(m.token_ids) == len(m.logprobs) and all(lp <= 0 for lp in m.logprobs)


def test_context_overflow_gives_none(policy):
    reqs = [(convo(0), TOOLS), (convo(1, extra=400), TOOLS), (convo(2), TOOLS)]
    out = policy.generate(reqs, default_sampling(max_new_tokens=4))
    assert out[1] is None and out[0] is not None and out[2] is not None
    assert len(out[0].token_ids) == 4
    assert policy.generate([], default_sampling()) == []


def test_local_chat_completer(policy):
    complete = completer(policy, max_new_tokens=5)
    text = complete([{"role": "system", "content": "You are a customer."}, {"role": "user", "content": "Hello"}])
    assert isinstance(text, str)


# ---- OpenAIPolicy against a real HTTP server -------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.received.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            srv.inflight += 1
            srv.max_inflight = max(srv.max_inflight, srv.inflight)
        try:
            last = body["messages"][-1]["content"] or ""
            time.sleep(0.05)
            if "fail500" in last:
                return self._send(500, {"error": "boom"})
            if "flaky" in last:
                with srv.lock:
                    srv.flaky += 1
                    n = srv.flaky
                if n <= 2:
                    return self._send(503, {"error": "busy"})
                return self._send(200, _completion(content="recovered"))
            if "toolong" in last:
                return self._send(
                    400, {"error": {"code": "context_length_exceeded", "message": "maximum context length is 10"}}
                )
            if "forbidden" in last:
                return self._send(403, {"error": "no"})
            if "badargs" in last:
                return self._send(
                    200,
                    _completion(
                        tool_calls=[
                            {
                                "id": "x1",
                                "type": "function",
                                "function": {"name": "cancel_pending_order", "arguments": "{not json"},
                            }
                        ]
                    ),
                )
            if "textcall" in last:
                return self._send(
                    200,
                    _completion(
                        content='<tool_call>\n{"name": "cancel_pending_order", "arguments": {"order_id": "#W3"}}\n</tool_call>'
                    ),
                )
            if "chat" in last:
                return self._send(200, _completion(content="hello from the server"))
            return self._send(
                200,
                _completion(
                    tool_calls=[
                        {
                            "id": "srv_1",
                            "type": "function",
                            "function": {
                                "name": "cancel_pending_order",
                                "arguments": json.dumps({"order_id": last[-4:], "reason": "x"}),
                            },
                        }
                    ]
                ),
            )
        finally:
            with srv.lock:
                srv.inflight -= 1

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _completion(content=None, tool_calls=None):
    msg = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {
        "id": "cmpl",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
    }


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.lock = threading.Lock()
    srv.received, srv.inflight, srv.max_inflight, srv.flaky = [], 0, 0, 0
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}/v1"


def user(text):
    return [SYSTEM, Message(role="user", content=text)]


def test_openai_tool_calls_concurrency_and_wire_format(server):
    pol = openai_policy(_url(server) + "/", "served-model", api_key="k123", concurrency=4, backoff_s=0.01)
    history = user("first") + [
        Message(
            role="assistant",
            tool_calls=[ToolCall(id="srv_0", name="cancel_pending_order", arguments={"order_id": "#W1"})],
        ),
        Message(role="tool", content='{"ok": true}', tool_call_id="srv_0", name="cancel_pending_order"),
    ]
    reqs = [(user(f"order #W{i:03d}"), TOOLS) for i in range(8)] + [
        (history + [Message(role="user", content="again #W999")], TOOLS)
    ]
    out = pol.generate(reqs, default_sampling(temperature=0.5, top_p=0.9, max_new_tokens=33, seed=3))
    assert [m.tool_calls[0].arguments["order_id"] for m in out] == [f"W{i:03d}" for i in range(8)] + ["W999"]
    assert out[0].tool_calls[0].id == "srv_1" and out[0].tool_calls[0].parse_error is None
    assert server.max_inflight > 1  # requests really ran concurrently
    first = server.received[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer k123"
    bodies = sorted((r["body"] for r in server.received), key=lambda b: b["seed"])
    assert [b["seed"] for b in bodies] == list(range(3, 12))
    b = bodies[-1]
    assert b["model"] == "served-model" and b["max_tokens"] == 33 and b["temperature"] == 0.5 and b["tools"] == TOOLS
    assert b["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"order_id": "#W1"}'
    assert b["messages"][3] == {
        "role": "tool",
        "tool_call_id": "srv_0",
        "content": '{"ok": true}',
        "name": "cancel_pending_order",
    }


def test_openai_bad_arguments_text_fallback_and_context(server):
    pol = openai_policy(_url(server), "m", backoff_s=0.01)
    bad, text, long_, chat = pol.generate(
        [(user(w), TOOLS) for w in ("badargs", "textcall", "toolong", "chat")], default_sampling()
    )
    (c,) = bad.tool_calls
    assert c.name == "cancel_pending_order" and c.arguments == {} and "not valid JSON" in c.parse_error
    assert text.tool_calls[0].arguments == {"order_id": "#W3"} and text.raw.startswith("<tool_call>")
    assert long_ is None
    assert chat.content == "hello from the server" and chat.tool_calls is None


def test_openai_retries_5xx_then_fails(server):
    pol = openai_policy(_url(server), "m", backoff_s=0.01)
    (m,) = pol.generate([(user("flaky"), TOOLS)], default_sampling())
    assert m.content == "recovered" and server.flaky == 3
    n = len(server.received)
    with pytest.raises(PolicyError, match="failed 4 times"):
        pol.generate([(user("fail500"), TOOLS)], default_sampling())
    assert len(server.received) - n == 4
    with pytest.raises(PolicyError, match="403"):
        pol.generate([(user("forbidden"), TOOLS)], default_sampling())


def test_openai_unreachable_fails_fast():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}/v1"
    pol = openai_policy(url, "m")
    t = time.perf_counter()
    with pytest.raises(PolicyError, match=f"127.0.0.1:{port}/v1/chat/completions"):
        pol.generate([(user("hi"), TOOLS)], default_sampling())
    assert time.perf_counter() - t < 5


def test_openai_chat_completer(server):
    complete = completer(openai_policy(_url(server), "m"), temperature=0.7)
    assert complete([{"role": "user", "content": "chat please"}]) == "hello from the server"
    assert "tools" not in server.received[-1]["body"] and server.received[-1]["body"]["temperature"] == 0.7


# ---- factories -------------------------------------------------------------------------------------------------


def test_the_llm_users_backends_take_their_settings_from_params(monkeypatch):
    """The local LLM user simulator runs with policy.max_context and policy.batch_size (it used LocalPolicy's own
    4,096 tokens while params said 6,144) and replies with user.max_new_tokens; the endpoint user waits
    user.timeout_s."""
    from trace_core.agents import factories
    from trace_core.agents import model as model_module

    built: list[dict] = []

    class Recorded:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(model_module, "provision_model", lambda path, cache_dir: "folder")
    monkeypatch.setattr(factories, "LocalPolicy", Recorded)
    monkeypatch.setattr(factories, "OpenAIPolicy", Recorded)
    params = load_params("params.yaml", {"user.kind": "llm", "user.model": "local", "policy.max_context": 5000,
                                         "policy.batch_size": 3})
    factories.make_user_completer(params)
    assert (built[-1]["max_context"], built[-1]["batch_size"]) == (5000, 3)
    params = load_params("params.yaml", {"user.kind": "llm", "user.model": "m", "user.base_url": "http://x/v1",
                                         "user.timeout_s": 7})
    factories.make_user_completer(params)
    assert built[-1]["timeout_s"] == 7


def test_make_policy(monkeypatch, tiny_model, tokenizer, server):
    monkeypatch.setenv("TRACE_POLICY_BASE_URL", _url(server))
    monkeypatch.setenv("MY_KEY", "sekret")
    params = load_params(
        "params.yaml", {"policy.backend": "openai", "policy.model": "m1", "policy.api_key_env": "MY_KEY"}
    )
    pol = make_policy(params)
    assert isinstance(pol, OpenAIPolicy) and pol.base_url == _url(server) and pol.api_key == "sekret"
    assert pol.name == "openai:m1"
    monkeypatch.delenv("TRACE_POLICY_BASE_URL")
    with pytest.raises(PolicyError, match="base_url"):
        make_policy(params)
    params = load_params("params.yaml", {"policy.batch_size": 3})
    local = make_policy(params, model=tiny_model, tokenizer=tokenizer)
    assert isinstance(local, LocalPolicy) and local.batch_size == 3 and local.max_context == params.policy.max_context
    s = sampling_from_params(params)
    assert (s.temperature, s.max_new_tokens, s.seed) == (
        params.policy.temperature,
        params.policy.max_new_tokens,
        params.seed,
    )


def test_prefix_sharing_and_cross_call_cache_match_plain_prefill(tiny_model, tokenizer):
    import copy

    model = copy.deepcopy(tiny_model)
    shared = local_policy(model, tokenizer, batch_size=3, threads=1)
    plain = local_policy(model, tokenizer, batch_size=3, threads=1, share_prefix=False, prefix_cache=False)
    reqs = [(convo(i, extra=i), TOOLS) for i in range(5)]
    s = default_sampling(max_new_tokens=6)

    def run(pol):
        return [(m.token_ids, m.logprobs) for m in pol.generate(reqs, s)]

    ref = run(plain)
    assert plain.prefix_stats == {"reused": 0, "computed": 0}
    got = run(shared)
    assert [g[0] for g in got] == [r[0] for r in ref]
    for g, r in zip(got, ref):
        assert g[1] == pytest.approx(r[1], abs=1e-4)
    computed = shared.prefix_stats["computed"]
    assert computed > 0 and shared.prefix_stats["reused"] > 0  # the second chunk reused the first's prefix
    # a later turn of one episode reuses its whole previous prompt
    (m,) = shared.generate([reqs[0]], s)
    follow = reqs[0][0] + [m, Message(role="user", content="and the other one?")]
    before = dict(shared.prefix_stats)
    (f,) = shared.generate([(follow, TOOLS)], s)
    (f_ref,) = plain.generate([(follow, TOOLS)], s)
    assert f.token_ids == f_ref.token_ids
    assert (
        shared.prefix_stats["reused"] - before["reused"]
        > len(tokenizer(render_prompt(tokenizer, reqs[0][0], TOOLS))["input_ids"]) - 2
    )
    # changing the weights in place invalidates the cached prefix
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    before = dict(shared.prefix_stats)
    after = run(shared)
    assert [a[0] for a in after] == [r[0] for r in run(plain)]
    assert shared.prefix_stats["computed"] > before["computed"]


def test_bench_decode_and_train_mode_is_restored(policy, tokenizer):
    path = Path(__file__).resolve().parents[2] / "bench" / "rollouts.py"
    spec = importlib.util.spec_from_file_location("bench_rollouts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench_decode = bench.bench_decode

    prompts = [
        tokenizer(render_prompt(tokenizer, convo(i), TOOLS), add_special_tokens=False)["input_ids"] for i in range(2)
    ]
    res = bench_decode(policy, prompts, new_tokens=3)
    assert set(res) == {"generate_tok_s", "loop_tok_s", "loop_shared_prefix_tok_s"} and min(res.values()) > 0
    policy.model.train()
    try:
        policy.generate([(convo(0), TOOLS)], default_sampling(max_new_tokens=2))
        assert policy.model.training
    finally:
        policy.model.eval()


def test_growing_kv_layer_appends_in_place_and_equals_concatenation():
    from transformers import DynamicCache, LlamaConfig
    from transformers.cache_utils import DynamicLayer

    from trace_core.agents.local import _growing

    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    grown, stock = _growing(DynamicCache(config=cfg)), DynamicCache(config=cfg)
    assert type(stock.layers[0]) is DynamicLayer and type(grown.layers[0]) is not DynamicLayer
    torch.manual_seed(0)

    def step(t, batch=3):
        k, v = torch.randn(batch, 1, t, 8), torch.randn(batch, 1, t, 8)
        for cache in (grown, stock):
            keys, values = cache.update(k, v, 0)
        assert torch.equal(keys, stock.layers[0].keys) and torch.equal(grown.layers[0].values, values)
        assert torch.equal(grown.layers[0].keys, stock.layers[0].keys)

    step(40)  # the prompt: one allocation with headroom
    buffer = grown.layers[0].keys.data_ptr()
    for _ in range(10):  # decoded tokens land in the same buffer
        step(1)
        assert grown.layers[0].keys.data_ptr() == buffer
    assert grown.get_seq_length() == stock.get_seq_length() == 50
    # Finished rows dropped: the selected rows are a new tensor, and the next update starts a new buffer.
    keep = torch.tensor([0, 2])
    for cache in (grown, stock):
        cache.batch_select_indices(keep)
    step(1, batch=2)
    assert grown.layers[0].keys.data_ptr() != buffer and grown.get_seq_length() == 51
    step(300, batch=2)  # beyond the headroom: grows
    assert grown.get_seq_length() == 351
    # select_rows: rows kept and leading positions trimmed in one copy that keeps spare room for later tokens.
    step(1, batch=2)
    layer, ref = grown.layers[0], stock.layers[0]
    layer.select_rows(torch.tensor([1]), lead=5)
    ref.keys, ref.values = ref.keys[[1], :, 5:, :], ref.values[[1], :, 5:, :]
    assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    buffer = layer.keys.data_ptr()
    step(1, batch=1)
    assert layer.keys.data_ptr() == buffer and grown.get_seq_length() == 352 - 5 + 1


def test_growing_cache_gives_the_stock_cache_tokens(tiny_model, tokenizer):
    stock = local_policy(tiny_model, tokenizer, batch_size=3, threads=1)
    stock.grow_in_place = False
    grown = local_policy(tiny_model, tokenizer, batch_size=3, threads=1)
    reqs = [(convo(i, extra=i), TOOLS) for i in range(5)]
    s = default_sampling(max_new_tokens=12)
    ref = stock.generate(reqs, s)
    got = grown.generate(reqs, s)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_decode_attention_equals_sdpa_with_gqa_and_padding():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trace_core.agents.local import _decode_attention

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    b, kv, L, d = 4, 2, 37, 16
    q = torch.randn(b, kv * 3, 1, d, dtype=torch.bfloat16)
    k, v = torch.randn(b, kv, L, d, dtype=torch.bfloat16), torch.randn(b, kv, L, d, dtype=torch.bfloat16)
    mask = torch.ones(b, 1, 1, L, dtype=torch.bool)
    mask[1, ..., :5] = False  # left padding of row 1
    mask[3, ..., :20] = False
    for m in (mask, None, torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)):
        ref, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), m if m is None else m.float() if m.dtype != torch.bool else m, scaling=0.25)
        got, _ = _decode_attention(module, q, k, v, m, scaling=0.25)
        assert got.shape == ref.shape == (b, 1, kv * 3, d)
        assert torch.allclose(got.float(), ref, atol=2e-2), (got.float() - ref).abs().max()
    # More than one query token (prefill) is SDPA's, unchanged.
    q2 = torch.randn(b, kv * 3, 5, d)
    k2, v2 = k.float(), v.float()
    assert torch.equal(_decode_attention(module, q2, k2, v2, None)[0], sdpa_attention_forward(module, q2, k2, v2, None)[0])


def test_cpu_decoding_uses_decode_attention_and_gives_sdpa_tokens(tiny_model, tokenizer, monkeypatch):
    from trace_core.agents import local

    assert tiny_model.config._attn_implementation == "sdpa"
    stock = local_policy(tiny_model, tokenizer, batch_size=3, threads=1, decode_attention=False)
    ours = local_policy(tiny_model, tokenizer, batch_size=3, threads=1)
    reqs = [(convo(i, extra=3 * i), TOOLS) for i in range(5)]  # different lengths: padded rows
    s = default_sampling(max_new_tokens=12)
    ref, got = stock.generate(reqs, s), ours.generate(reqs, s)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert tiny_model.config._attn_implementation == "sdpa"  # restored

    # It is really what runs: an attention function that fails makes generation fail, and the config is restored.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def broken(*args, **kwargs):
        raise RuntimeError("decode attention called")

    AttentionInterface.register("trace_test_broken", broken)
    AttentionMaskInterface.register("trace_test_broken", sdpa_mask)
    monkeypatch.setattr(local, "_decode_attention_name", lambda: "trace_test_broken")
    ours.clear_prefix_cache()
    with pytest.raises(RuntimeError, match="decode attention called"):
        ours.generate(reqs[:1], s)
    assert tiny_model.config._attn_implementation == "sdpa"


def test_next_turn_of_a_batch_reuses_each_rows_kv(tiny_model, tokenizer):
    """The second turn of three episodes generated together starts from each episode's own KV of the first turn
    (prompt and generated tokens), and gives the tokens of a policy that prefills everything."""
    cached = local_policy(tiny_model, tokenizer, batch_size=3, threads=1)
    plain = local_policy(tiny_model, tokenizer, batch_size=3, threads=1, share_prefix=False,
                                   prefix_cache=False)
    assert plain.row_cache is False
    s = default_sampling(max_new_tokens=10)
    first = [(convo(i, extra=i), TOOLS) for i in range(3)]
    replies = cached.generate(first, s)
    assert [m.token_ids for m in replies] == [m.token_ids for m in plain.generate(first, s)]
    follow = [(c + [m, Message(role="user", content=f"and order #W{i}?")], t)
              for i, ((c, t), m) in enumerate(zip(first, replies))]
    before = cached.prefix_stats["reused"]
    got, ref = cached.generate(follow, s), plain.generate(follow, s)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    # Each row reused at least its whole first prompt (not just the prefix the three prompts share).
    first_lengths = [len(tokenizer(render_prompt(tokenizer, c, t))["input_ids"]) for c, t in first]
    assert cached.prefix_stats["reused"] - before >= sum(first_lengths) - 3
    # Other weights: nothing is reused.
    cached.clear_prefix_cache()
    assert cached._matching_rows([[1, 2, 3]], cached._weights_fingerprint(), 0) == [None]


def test_length_groups():
    from trace_core.agents.local import _length_groups

    assert _length_groups([40, 2000, 60, 1900]) == [[0, 2], [3, 1]]
    assert _length_groups([40, 124, 30]) == [[0, 1, 2]]  # one group keeps the input order
    assert _length_groups([40, 125, 30]) == [[2, 0], [1]]
    assert _length_groups([5]) == [[0]]


def test_running_and_new_episodes_are_prefilled_apart_with_the_same_tokens(tiny_model, tokenizer, monkeypatch):
    """Next turns of running episodes (a few new tokens each, after their own KV) batched with new episodes whose
    system prompt is different (hundreds of new tokens): the two kinds are prefilled in separate groups, merged
    for decoding, and give the tokens and log-probs of a policy that prefills every row in full."""
    cached = local_policy(tiny_model, tokenizer, batch_size=4, threads=1)
    plain = local_policy(tiny_model, tokenizer, batch_size=4, threads=1, share_prefix=False,
                                   prefix_cache=False)
    s = default_sampling(max_new_tokens=8)
    first = [(convo(i, extra=i), TOOLS) for i in range(2)]
    replies = cached.generate(first, s)
    follow = [(c + [m, Message(role="user", content="ok")], t) for (c, t), m in zip(first, replies)]
    # Each new episode has its own system prompt, so the two share nothing beyond the batch-wide prefix.
    new = [([Message(role="system", content=f"Desk {i}. " + "Be brief and exact. " * 40),
             Message(role="user", content=f"Rebook flight HAT{i}.")], []) for i in range(2)]
    merges = []
    merge = LocalPolicy._merge
    monkeypatch.setattr(LocalPolicy, "_merge", lambda self, parts, config: merges.append(len(parts)) or merge(
        self, parts, config))
    got = cached.generate(follow + new, s)
    assert merges == [2]
    ref = plain.generate(follow + new, s)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for g, r in zip(got, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)


def test_groups_of_prompts_prefill_their_shared_prefix_once(tiny_model, tokenizer):
    """Six new episodes in two groups whose long system prompts differ (three rows each, sharing only the
    template's opening): each group's prompt prefix is prefilled once (the prefix tree's branch point) instead of
    once per row, and the tokens and log-probs are those of a policy that prefills every row in full."""
    def requests(tag: str) -> list:
        return [([Message(role="system", content=f"{g} desk {tag}. " + f"Rule {g}: be brief. " * 30),
                  Message(role="user", content=f"Rebook flight HAT{g}{i}.")], []) for g in "AB" for i in range(3)]

    def run(pol, reqs):
        fed = []
        hook = pol.model.register_forward_pre_hook(
            lambda mod, args, kw: fed.append(int(kw["input_ids"].numel())), with_kwargs=True)
        try:
            return pol.generate(reqs, default_sampling(max_new_tokens=6)), sum(fed)
        finally:
            hook.remove()

    tree = local_policy(tiny_model, tokenizer, batch_size=6, threads=1)
    flat = local_policy(tiny_model, tokenizer, batch_size=6, threads=1)
    flat.branch_prefixes = False
    plain = local_policy(tiny_model, tokenizer, batch_size=6, threads=1, share_prefix=False,
                                   prefix_cache=False)
    reqs = requests("one")
    (got, fed_tree), (same, fed_flat), (ref, _) = run(tree, reqs), run(flat, reqs), run(plain, reqs)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref] == [m.token_ids for m in same]
    for g, r in zip(got, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    lengths = [len(tokenizer(render_prompt(tokenizer, c, t))["input_ids"]) for c, t in reqs]
    group_prefix = min(lengths) - 12  # each group's rows differ only in their last user line
    assert fed_flat - fed_tree > 4 * (group_prefix - 40)  # 4 of the 6 rows no longer prefill their group's prefix
    # The branch points are keyed on the weights like every other cached KV: new requests, fresh prefixes.
    (again, _) = run(tree, requests("two"))
    assert [a.token_ids for a in again] == [r.token_ids for r in run(plain, requests("two"))[0]]
