"""A model's generation_config.json (vLLM's `--generation-config`): its EOS ids end requests on top of
config.json's, and its sampling fields are the defaults of whatever a request leaves unset (`LLM.generate`
without params, the OpenAI server); "vllm" ignores the file, a directory path reads the one there, and a
malformed file is a ValueError naming the file and the field."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import openai
import pytest
from test_server_harness import API_KEY, MODEL, Server

from jengine import LLM, SamplingParams
from jengine.cli import build_parser, engine_kwargs
from jengine.config import ModelConfig
from jengine.data_parallel import DataParallelEngine
from jengine.engine_config import EngineConfig
from jengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jengine.generation_config import GenerationConfig, load_generation_config, read_generation_config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "models", "llama")  # eos_token_id 2, no tokenizer
_EXPECTED = np.load(os.path.join(FIXTURE, "expected.npz"))
PROMPT, GREEDY = _EXPECTED["prompt_1"].tolist(), _EXPECTED["greedy_1"].tolist()  # transformers' 16 greedy tokens
STOP_AT = 5
END_OF_TURN = GREEDY[STOP_AT]  # the generation config's extra EOS: greedy decoding reaches it at output 6
assert END_OF_TURN not in GREEDY[:STOP_AT] and END_OF_TURN != 2
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16)
# As transformers writes them: the keys jengine reads, and others it must ignore.
GENERATION = {"bos_token_id": 1, "eos_token_id": [2, END_OF_TURN], "pad_token_id": 0, "do_sample": True,
              "temperature": 0.0, "max_new_tokens": 3, "transformers_version": "4.45.0"}
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64),
              seq_buckets=(4,))
SMALL = dict(ENGINE, use_tqdm_on_load=False)


def _write(directory, generation) -> str:
    """`directory` holding a generation_config.json of `generation` (a dict, or the file's raw text)."""
    os.makedirs(directory, exist_ok=True)
    text = generation if isinstance(generation, str) else json.dumps(generation)
    pathlib.Path(directory, "generation_config.json").write_text(text)
    return str(directory)


def _model_with(directory, generation) -> str:
    """A copy of the tiny llama checkpoint with a generation_config.json."""
    for name in ("config.json", "model.safetensors"):
        os.makedirs(directory, exist_ok=True)
        shutil.copy(os.path.join(FIXTURE, name), directory)
    return _write(directory, generation)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_with(tmp_path_factory.mktemp("with-generation-config"), GENERATION)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SMALL)


@pytest.fixture(scope="module")
def llm_vllm(model_dir):
    return LLM(model_dir, generation_config="vllm", **SMALL)


# ---------------------------------------------------------------------- reading the file

def test_reads_the_eos_ids_and_vllms_sampling_fields_and_ignores_every_other_key(tmp_path):
    path = os.path.join(_write(tmp_path, {
        "eos_token_id": [128001, 128009, 128001], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_new_tokens": 256, "do_sample": True, "bos_token_id": 128000,
        "pad_token_id": None, "presence_penalty": 1.5, "length_penalty": 2.0, "transformers_version": "4.45.0"}),
        "generation_config.json")
    assert read_generation_config(path) == GenerationConfig(
        path=path, eos_token_ids=(128001, 128009),
        sampling_defaults={"repetition_penalty": 1.05, "temperature": 0.6, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
                           "max_tokens": 256})


def test_values_equal_to_transformers_defaults_set_nothing_as_in_vllm(tmp_path):
    """vLLM reads the file through transformers' `to_diff_dict`: a written `top_k: 50` (transformers'
    default) must not switch top-k on."""
    path = os.path.join(_write(tmp_path, {"top_k": 50, "temperature": 1.0, "top_p": 1, "repetition_penalty": 1.0,
                                          "min_p": 0.0, "max_new_tokens": 20}), "generation_config.json")
    assert read_generation_config(path).sampling_defaults == {"min_p": 0.0, "max_tokens": 20}


def test_a_single_eos_id_and_null_fields(tmp_path):
    path = os.path.join(_write(tmp_path, {"eos_token_id": 7, "temperature": None, "max_new_tokens": None}),
                        "generation_config.json")
    assert read_generation_config(path) == GenerationConfig(path=path, eos_token_ids=(7,))


def test_auto_reads_the_model_directorys_file_vllm_ignores_it_and_a_directory_path_reads_its_own(tmp_path,
                                                                                               model_dir):
    auto = load_generation_config("auto", model_dir)
    assert auto.eos_token_ids == (2, END_OF_TURN) and auto.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
    assert load_generation_config("vllm", model_dir) == GenerationConfig()
    other = _write(tmp_path / "other", {"top_p": 0.5})
    assert load_generation_config(other, model_dir).sampling_defaults == {"top_p": 0.5}
    assert load_generation_config(other, FIXTURE).sampling_defaults == {"top_p": 0.5}


def test_a_model_or_preset_without_the_file_has_no_generation_config():
    assert load_generation_config("auto", FIXTURE) == GenerationConfig()
    assert load_generation_config("auto", MODEL) == GenerationConfig()  # the built-in preset
    assert load_generation_config("auto", "jengine/llama-3.1-8b") == GenerationConfig()


def test_a_generation_config_path_without_the_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="generation_config=.*no such directory"):
        load_generation_config(str(tmp_path / "missing"), FIXTURE)
    with pytest.raises(ValueError, match="generation_config=.*holds no generation_config.json"):
        load_generation_config(str(tmp_path), FIXTURE)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"eos_token_id": "2"}', "eos_token_id must be a token id"),
    ('{"eos_token_id": [2, "x"]}', "eos_token_id must be a token id"),
    ('{"eos_token_id": true}', "eos_token_id must be a token id"),
    ('{"eos_token_id": -1}', "eos_token_id must be a token id"),
    ('{"eos_token_id": 2.0}', "eos_token_id must be a token id"),
    ('{"temperature": "hot"}', "temperature is invalid: temperature must be finite and >= 0"),
    ('{"temperature": -0.5}', "temperature is invalid"),
    ('{"top_p": 0}', "top_p is invalid: top_p must be in"),
    ('{"top_k": 2.5}', "top_k is invalid"),
    ('{"min_p": 2}', "min_p is invalid"),
    ('{"repetition_penalty": 0}', "repetition_penalty is invalid"),
    ('{"max_new_tokens": 0}', "max_new_tokens is invalid: max_tokens must be"),
    ('{"max_new_tokens": true}', "max_new_tokens is invalid"),
])
def test_a_malformed_file_is_a_value_error_naming_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message) as err:
        load_generation_config(str(tmp_path), FIXTURE)
    assert str(path) in str(err.value)


def test_eos_ids_join_config_jsons_in_order_once_each_and_must_be_in_the_vocabulary():
    cfg = ModelConfig.from_model_dir(FIXTURE)  # eos_token_id 2, vocab 256
    assert GenerationConfig("g.json", (9, 2, 7)).with_eos_of(cfg).eos_token_ids == (2, 9, 7)
    assert GenerationConfig().with_eos_of(cfg) == cfg
    with pytest.raises(ValueError, match="g.json: eos_token_id 256 is outside the vocabulary"):
        GenerationConfig("g.json", (5, 256)).with_eos_of(cfg)


# ---------------------------------------------------------------------- the switch

def test_engine_config_takes_auto_vllm_or_a_path_and_the_cli_flag_sets_it(tmp_path):
    assert EngineConfig(model=FIXTURE).generation_config == "auto"
    assert EngineConfig(model=FIXTURE, generation_config=tmp_path).generation_config == str(tmp_path)
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a directory"):
            EngineConfig(model=FIXTURE, generation_config=bad)
    parser = build_parser()
    for command in ("generate", "serve"):
        assert engine_kwargs(parser.parse_args([command]))["generation_config"] == "auto"
        args = parser.parse_args([command, FIXTURE, "--generation-config", "vllm"])
        assert EngineConfig(model=args.model, **engine_kwargs(args)).generation_config == "vllm"


def test_a_bad_generation_config_stops_the_engine_before_it_loads_anything(tmp_path):
    with pytest.raises(ValueError, match="generation_config=.*no such directory"):
        LLM(FIXTURE, generation_config=str(tmp_path / "missing"), **SMALL)
    with pytest.raises(ValueError, match="temperature is invalid"):
        LLM(_model_with(tmp_path / "bad", {"temperature": -1}), **SMALL)


# ---------------------------------------------------------------------- override_generation_config

def test_overrides_set_keys_over_the_files_in_any_mode_and_a_null_unsets_one(model_dir):
    file = load_generation_config("auto", model_dir)  # temperature 0.0, max_new_tokens 3
    got = load_generation_config("auto", model_dir, {"temperature": 1.0, "top_k": 50, "max_new_tokens": None})
    # as given, even transformers' defaults (vLLM applies the override after to_diff_dict)
    assert got.sampling_defaults == {"temperature": 1.0, "top_k": 50}
    assert got.eos_token_ids == file.eos_token_ids
    assert load_generation_config("vllm", model_dir, {"top_p": 0.5}).sampling_defaults == {"top_p": 0.5}
    assert load_generation_config("auto", FIXTURE, {"min_p": 0.1}).sampling_defaults == {"min_p": 0.1}


@pytest.mark.parametrize("override,message", [
    ({"temprature": 0.5}, r"override_generation_config: unknown key\(s\) \['temprature'\]"),
    ({"eos_token_id": 3}, r"unknown key\(s\) \['eos_token_id'\]"),
    ({"top_p": 0.0}, "override_generation_config: top_p is invalid"),
    ({"max_new_tokens": "lots"}, "override_generation_config: max_new_tokens is invalid"),
])
def test_a_bad_override_is_a_value_error_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_generation_config("vllm", FIXTURE, override)


def test_engine_config_and_the_cli_flag_take_an_override_object():
    override = {"temperature": 0.3}
    config = EngineConfig(model=FIXTURE, override_generation_config=override)
    override["temperature"] = 9.0  # the config keeps its own copy
    assert config.override_generation_config == {"temperature": 0.3} and hash(config) == hash(EngineConfig(FIXTURE))
    for bad in ([("temperature", 0.3)], {1: 0.3}, "temperature=0.3"):
        with pytest.raises(ValueError, match="override_generation_config must be None or a dict"):
            EngineConfig(model=FIXTURE, override_generation_config=bad)
    parser = build_parser()
    args = parser.parse_args(["serve", FIXTURE, "--override-generation-config", '{"top_k": 20, "min_p": null}'])
    assert engine_kwargs(args)["override_generation_config"] == {"top_k": 20, "min_p": None}
    assert engine_kwargs(parser.parse_args(["generate"]))["override_generation_config"] is None
    for bad in ("{top_k: 20}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--override-generation-config", bad])


def test_the_engine_applies_the_override_to_its_defaults(model_dir):
    llm = LLM(model_dir, override_generation_config={"max_new_tokens": 2, "top_k": 7}, **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=2, top_k=7)
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (GREEDY[:2], "length")


# ---------------------------------------------------------------------- the engine

def test_the_generation_configs_eos_ends_requests_and_vllm_mode_runs_past_it(llm, llm_vllm):
    assert llm.engine.model_config.eos_token_ids == (2, END_OF_TURN)
    out = llm.generate([PROMPT], GREEDY16, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (GREEDY[:STOP_AT + 1], "stop", END_OF_TURN)
    ignored = llm.generate([PROMPT], GREEDY16.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (ignored.token_ids, ignored.finish_reason) == (GREEDY, "length")
    assert llm_vllm.engine.model_config.eos_token_ids == (2,)
    out = llm_vllm.generate([PROMPT], GREEDY16, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (GREEDY, "length")


def test_data_parallel_replicas_expose_the_merged_eos_ids_and_the_defaults(model_dir):
    engine = DataParallelEngine(EngineConfig(model=model_dir, **ENGINE), progress=False)  # one replica here
    assert engine.model_config.eos_token_ids == (2, END_OF_TURN)
    assert engine.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}


def test_min_tokens_holds_back_the_generation_configs_eos_too(llm):
    out = llm.generate([PROMPT], GREEDY16.clone(min_tokens=STOP_AT + 1), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:STOP_AT] == GREEDY[:STOP_AT] and out.token_ids[STOP_AT] != END_OF_TURN


def test_compiled_programs_see_the_checkpoints_config_so_their_cache_keys_do_not_change(llm, llm_vllm):
    assert llm.engine.runner.cfg == llm_vllm.engine.runner.cfg
    assert llm.engine.runner.cfg.eos_token_ids == (2,)


def test_generate_without_params_uses_the_generation_configs_defaults(llm, llm_vllm):
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (GREEDY[:3], "length")  # greedy, 3 tokens
    assert llm_vllm.engine.sampling_defaults == {}
    assert llm_vllm.get_default_sampling_params() == SamplingParams()


def test_explicit_params_win_over_the_generation_configs_defaults(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == GREEDY[:2]
    sampled = llm.generate([PROMPT], SamplingParams(temperature=5.0, max_tokens=16, seed=1, ignore_eos=True),
                           use_tqdm=False)
    assert sampled[0].outputs[0].token_ids != GREEDY  # temperature 5 does not decode greedily


# ---------------------------------------------------------------------- the OpenAI server

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
            "max_tokens": 33}
HI = [{"role": "user", "content": "hi"}]


def test_a_chat_request_takes_the_defaults_for_what_it_leaves_unset():
    params = ChatCompletionRequest(messages=HI).to_sampling_params(DEFAULTS)
    assert params == SamplingParams(**DEFAULTS)
    explicit = ChatCompletionRequest(messages=HI, temperature=0.2, top_k=-1, max_tokens=4).to_sampling_params(DEFAULTS)
    assert (explicit.temperature, explicit.top_k, explicit.top_p, explicit.max_tokens) == (0.2, 0, 0.9, 4)
    assert ChatCompletionRequest(messages=HI, max_completion_tokens=5).to_sampling_params(DEFAULTS).max_tokens == 5
    assert ChatCompletionRequest(messages=HI).to_sampling_params() == SamplingParams(max_tokens=None)
    assert ChatCompletionRequest(messages=HI).to_sampling_params({}) == SamplingParams(max_tokens=None)


def test_a_completion_request_keeps_openais_max_tokens_default_of_16_even_when_sent_null_as_in_vllm():
    params = CompletionRequest(prompt="a").to_sampling_params(DEFAULTS)
    assert params == SamplingParams(**{**DEFAULTS, "max_tokens": 16})
    assert CompletionRequest(prompt="a", max_tokens=None).to_sampling_params(DEFAULTS).max_tokens == 16
    assert CompletionRequest(prompt="a", temperature=0).to_sampling_params(DEFAULTS).is_greedy


def test_the_server_applies_a_generation_config_directory_to_requests_and_its_max_new_tokens_caps_them(tmp_path):
    """As vLLM's server: a --generation-config directory's max_new_tokens is a ceiling for every request (a
    model directory's own file gives only a default: `test_max_tokens_is_vllms_smallest_of_...`)."""
    srv = Server("--generation-config", _write(tmp_path, {"temperature": 0.0, "max_new_tokens": 5}))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        chat = lambda **kw: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=HI, extra_body={"ignore_eos": True}, **kw)
        defaulted = [chat() for _ in range(2)]  # greedy, 5 tokens: not temperature 1 up to max_model_len
        greedy = chat(temperature=0, max_tokens=5)
        assert [r.usage.completion_tokens for r in defaulted] == [5, 5]
        assert defaulted[0].choices[0].message.content == defaulted[1].choices[0].message.content
        assert defaulted[0].choices[0].message.content == greedy.choices[0].message.content
        assert chat(max_tokens=2).usage.completion_tokens == 2
        assert [chat(max_tokens=9).usage.completion_tokens, chat(max_completion_tokens=200).usage.completion_tokens] \
            == [5, 5]
        text = lambda **kw: client.completions.create(  # noqa: E731
            model=MODEL, prompt="Hello", extra_body={"ignore_eos": True}, **kw)
        completion = text()
        assert completion.usage.completion_tokens == 5  # OpenAI's default of 16, capped
        assert completion.choices[0].text == text(temperature=0, max_tokens=5).choices[0].text
        with pytest.raises(openai.BadRequestError, match="max_model_len=256") as err:
            chat(max_tokens=300)  # more than the context holds is an error even above the ceiling, as in vLLM
        assert err.value.param == "max_tokens"
    finally:
        assert srv.stop() == 0


def test_max_tokens_is_vllms_smallest_of_the_request_or_default_the_prompts_room_and_the_ceiling():
    from jengine.entrypoints.max_tokens import generation_ceiling, max_tokens_for

    # A --generation-config directory's max_new_tokens caps every request; the model directory's own file
    # ("auto") and "vllm" give no cap; --override-generation-config's caps in any mode (a null one unsets it).
    assert generation_ceiling("/a/dir", {"max_tokens": 5}, None) == 5
    assert generation_ceiling("auto", {"max_tokens": 5}, None) is generation_ceiling("vllm", {}, None) is None
    assert generation_ceiling("auto", {"max_tokens": 7}, {"max_new_tokens": 7, "top_k": 3}) == 7
    assert generation_ceiling("auto", {}, {"max_new_tokens": None}) is None

    def fit(prompt_len, requested, **kw):
        return max_tokens_for(prompt_len, requested, max_model_len=100, **kw)

    assert (fit(10, None), fit(10, None, default=33), fit(80, None, default=33), fit(99, None)) == (90, 33, 20, 1)
    assert (fit(10, 50, default=33), fit(10, 50, ceiling=5), fit(10, None, default=33, ceiling=5)) == (50, 5, 5)
    with pytest.raises(ValueError, match=r"^max_completion_tokens=91 plus the prompt's 10 tokens is 101, more than "
                                         r"max_model_len=100; ask for at most 90"):
        fit(10, 91, ceiling=5, param="max_completion_tokens")  # the request's own value is checked, as in vLLM
    with pytest.raises(ValueError, match="prompt of 100 tokens leaves no room to generate"):
        fit(100, None)


@pytest.mark.parametrize("setting,override,request_max,want", [
    ("auto", None, None, 33), ("auto", None, 50, 50),  # the model's own file: a default only
    ("DIR", None, None, 33), ("DIR", None, 50, 33),  # --generation-config DIR: a ceiling
    ("auto", {"max_new_tokens": 20}, 50, 20), ("vllm", None, None, 256 - 3),
])
def test_the_server_takes_max_tokens_by_vllms_rule_for_each_generation_config_mode(tmp_path, setting, override,
                                                                                    request_max, want):
    from types import SimpleNamespace

    from jengine.entrypoints.openai_serving import OpenAIServing

    setting = str(tmp_path) if setting == "DIR" else setting
    config = EngineConfig(model=FIXTURE, max_model_len=256, generation_config=setting,
                          override_generation_config=override)
    defaults = {} if setting == "vllm" else {"max_tokens": 33 if override is None else override["max_new_tokens"]}
    engine = SimpleNamespace(config=config, model_config=None, sampling_defaults=defaults)
    serving = OpenAIServing(SimpleNamespace(engine=engine), "m", None)
    req = ChatCompletionRequest(messages=HI, max_completion_tokens=request_max)
    assert serving._with_max_tokens(req, req.to_sampling_params(defaults), [1, 2, 3]).max_tokens == want
