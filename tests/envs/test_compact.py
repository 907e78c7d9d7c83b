"""The compact profile's tool schemas keep the interface (names, parameters, types, required) and drop prose."""

from trace_core.envs.tau2_env import Tau2Environment, compact_schema


def _interface(schema):
    params = schema["function"]["parameters"]
    props = {name: {k: v for k, v in p.items() if k not in ("description", "title")} for name, p in params.get("properties", {}).items()}
    return schema["function"]["name"], props, sorted(params.get("required", []))


def test_compact_schemas_keep_the_interface_of_every_retail_tool():
    full = Tau2Environment("retail", "full").tool_schemas()
    compact = Tau2Environment("retail", "compact").tool_schemas()
    assert [_interface(s) for s in full] == [_interface(s) for s in compact]
    for s in compact:
        text = str(s)
        assert "'title'" not in text.replace("'title': {", "")  # no pydantic titles (a parameter may be named title)
        assert len(s["function"]["description"]) <= len(next(f for f in full if f["function"]["name"] == s["function"]["name"])["function"]["description"])


def test_compact_schema_keeps_a_parameter_named_title_and_cuts_descriptions():
    schema = {"type": "function", "function": {"name": "f", "description": "One. Two.", "parameters": {
        "title": "parameters", "type": "object", "required": ["title"],
        "properties": {"title": {"title": "Title", "type": "string", "description": "A title. Long prose."}}}}}
    out = compact_schema(schema)
    assert out["function"]["description"] == "One."
    assert out["function"]["parameters"]["properties"]["title"] == {"type": "string", "description": "A title."}
    assert "title" not in out["function"]["parameters"] or out["function"]["parameters"].get("title") != "parameters"
