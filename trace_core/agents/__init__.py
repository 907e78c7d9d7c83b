"""The agent runtime's model side: provisioning (`model`), tool-call parsing (`parsing`), chat-format
conversions (`chat`) and the policy backends (`policy` the interface, `local` and `openai_client` the two
backends, `factories` building them from the params). Importing this package is cheap: torch and
transformers are imported inside the functions that need them."""

from trace_core.agents.chat import (
    render_assistant,
    render_conversation,
    render_prompt,
    to_hf_messages,
    to_openai_messages,
)
from trace_core.agents.factories import chat_completer, make_policy, make_user_completer, sampling_from_params
from trace_core.agents.local import LocalPolicy
from trace_core.agents.model import ModelProvisionError, load_model, load_tokenizer, provision_model
from trace_core.agents.openai_client import OpenAIPolicy
from trace_core.agents.parsing import parse_assistant
from trace_core.agents.policy import Policy, PolicyError, Sampling

__all__ = [
    "LocalPolicy",
    "ModelProvisionError",
    "OpenAIPolicy",
    "Policy",
    "PolicyError",
    "Sampling",
    "chat_completer",
    "load_model",
    "load_tokenizer",
    "make_policy",
    "make_user_completer",
    "parse_assistant",
    "provision_model",
    "render_assistant",
    "render_conversation",
    "render_prompt",
    "sampling_from_params",
    "to_hf_messages",
    "to_openai_messages",
]
