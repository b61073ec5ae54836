"""JSON-schema constrained output on the bundled model parses: by default the grammar allows
no run of whitespace between tokens, which a small model otherwise fills with newlines until
it runs out of tokens; --constrained-json-allow-any-whitespace still gives the free form."""

import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.messages import SamplingParams
from scheduler.model_runner import ModelRunner, load_model

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# Chat prompts as the router sends them; allowed any whitespace, the model pads the first two
# with newlines until max_new_tokens.
PROMPTS = ["Hello", "Paris", "Name a city.", "A person:"]


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(device="cpu"))


def test_json_schema_output_parses_and_has_the_required_keys(loaded):
    from scheduler.stop_strings import load_tokenizer

    config = EngineConfig(device="cpu", kv_cache_tokens=4096)  # the default: compact JSON
    engine = Engine(config, ModelRunner(config, loaded))
    tokenizer = load_tokenizer(engine.runner.model_path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    sp = SamplingParams(
        temperature=0.0, max_new_tokens=64, constraint_kind="json_schema", constraint=json.dumps(SCHEMA)
    )
    outputs = engine.generate([tokenizer.encode(p, add_special_tokens=False) for p in prompts], sp)
    texts = [tokenizer.decode(c.output_ids) for c in outputs]
    eos = engine.scheduler.eos_token_ids
    assert all(c.finish_reason == "stop" and c.output_ids[-1] in eos for c in outputs), texts  # the grammar ended them
    for c in outputs:
        text = tokenizer.decode(c.output_ids[:-1])
        value = json.loads(text)
        assert isinstance(value, dict) and set(SCHEMA["required"]) <= set(value), texts
        assert "\n" not in text, texts


def compiled_matcher(engine, spec: str):
    """The matcher a request with this json_schema gets (through the engine's compile workers)."""
    import time
    from types import SimpleNamespace

    engine.grammars.submit(SimpleNamespace(request_id=spec), "json_schema", spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = engine.grammars.poll(wait_briefly=True)
        assert not done.refused, done.refused
        if done.ready:
            return done.ready[0][1]
    raise AssertionError("the grammar never compiled")


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_the_whitespace_setting_decides_what_json_the_grammar_accepts(loaded, any_whitespace):
    """Both settings compile, json_schema and the router's json_object ({"type": "object"});
    only the free form accepts a newline between tokens."""
    config = EngineConfig(device="cpu", kv_cache_tokens=256, constrained_json_any_whitespace=any_whitespace)
    engine = Engine(config, ModelRunner(config, loaded))
    for spec, text in ((json.dumps(SCHEMA), '{\n  "name"'), ('{"type": "object"}', '{\n  "a"')):
        matcher = compiled_matcher(engine, spec)
        assert matcher.accept_string(text[0])
        assert matcher.accept_string(text[1:]) == any_whitespace
    engine.grammars.close()
