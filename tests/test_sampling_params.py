"""SamplingParams: vLLM defaults, normalisation, and validation messages naming field and range."""

import subprocess
import sys

import pytest

from jengine.sampling_params import SamplingParams as P


def test_defaults_follow_vllm():
    p = P()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias == {}
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.uses_penalties


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n=0), "n must be an int >= 1, got 0"),
        (dict(temperature=-1), "temperature must be finite and >= 0, got -1"),
        (dict(temperature=float("inf")), "temperature must be finite and >= 0, got inf"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), "top_k must be 0 or -1 .*, got -2"),
        (dict(min_p=1.1), r"min_p must be in \[0, 1\], got 1.1"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0, got 0.0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite and > 0, got inf"),
        (dict(max_tokens=0), "max_tokens must be None or an int >= 1, got 0"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0, got -1"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens=4, got 5"),
        (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\], got 21"),
        (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or an int in \[0, 20\], got -1"),
        (dict(seed=1.5), "seed must be an int or None, got 1.5"),
        (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens must be None, -1 \(max_model_len\) or an int >= 1, "
                                         "got 0"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be None, -1"),
        (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens must be None, -1"),
        (dict(stop=[""]), "stop must be a non-empty string"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be ints >= 0, got -1"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias may have at most 300 entries, got 301"),
        (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\] must be a number, got nan"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
        (dict(flat_logprobs=1), "flat_logprobs must be True or False, got 1"),
        (dict(skip_special_tokens=None), "skip_special_tokens must be True or False, got None"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be True or False, got 1"),
        (dict(detokenize="yes"), "detokenize must be True or False"),
        (dict(spaces_between_special_tokens=0), "spaces_between_special_tokens must be True or False"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must name at least one token"),
        (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids must be token ids \(ints >= 0\), got -1"),
        (dict(allowed_token_ids=[1.5]), "allowed_token_ids must be token ids .*, got 1.5"),
        (dict(allowed_token_ids=[True]), "allowed_token_ids must be token ids .*, got True"),
        (dict(allowed_token_ids=["7"]), "allowed_token_ids must be token ids .*, got '7'"),
        (dict(allowed_token_ids=5), "allowed_token_ids must be a list, got int"),
        (dict(bad_words="word"), "bad_words must be a list, got str"),
        (dict(bad_words=["ok", 5]), "bad_words must be non-empty strings, got 5"),
        (dict(bad_words=[""]), "bad_words must be non-empty strings, got ''"),
        (dict(bad_words=[["nested"]]), r"bad_words must be non-empty strings, got \['nested'\]"),
    ],
)
def test_bad_values_raise_naming_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P(**kwargs)


def test_normalisation():
    p = P(stop="###", top_k=-1, logit_bias={"7": 250, 3: -1000.0}, max_tokens=None, min_tokens=100)
    assert p.stop == ["###"] and p.top_k == 0 and p.max_tokens is None
    assert p.logit_bias == {7: 100.0, 3: -100.0}  # keys as ints, values clamped like vLLM


def test_allowed_token_ids_and_bad_words_lose_repeats_and_survive_clone():
    np = pytest.importorskip("numpy")
    p = P(allowed_token_ids=(5, 3, 5, np.int64(9)), bad_words=["foo", "bar", "foo"])
    assert p.allowed_token_ids == [5, 3, 9] and all(type(t) is int for t in p.allowed_token_ids)
    assert p.bad_words == ["foo", "bar"]
    assert P().allowed_token_ids is None and P().bad_words == []
    assert P(allowed_token_ids=np.array([4, 2])).allowed_token_ids == [4, 2]
    child = p.clone(seed=1)
    child.allowed_token_ids.append(7)
    child.bad_words.append("baz")
    assert (child.allowed_token_ids, child.bad_words) == ([5, 3, 9, 7], ["foo", "bar", "baz"])
    assert (p.allowed_token_ids, p.bad_words) == ([5, 3, 9], ["foo", "bar"])


def test_bias_table_entries_count_what_a_row_can_need():
    # allowed ids alone: logit_bias, suppressed stops and bans of other ids are masked out anyway
    assert P(allowed_token_ids=[1, 2, 3], logit_bias={9: 1.0}, min_tokens=2).bias_table_entries([7], {8}) == 3
    assert P(logit_bias={1: 1.0, 2: 1.0}).bias_table_entries([7], {2, 8}) == 3  # stops only with min_tokens
    assert P(logit_bias={1: 1.0}, stop_token_ids=[5], min_tokens=1).bias_table_entries([7]) == 3


def test_numpy_scalars_are_taken_as_the_python_values_they_hold():
    np = pytest.importorskip("numpy")
    p = P(temperature=np.float32(0.5), top_k=np.int64(5), max_tokens=np.int32(7), seed=np.uint64(3),
          ignore_eos=np.True_, stop_token_ids=np.array([4, 9]), logit_bias={np.int64(2): np.float32(1.5)})
    assert (p.temperature, p.top_k, p.max_tokens, p.seed, p.ignore_eos) == (0.5, 5, 7, 3, True)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.ignore_eos) is bool
    assert p.stop_token_ids == [4, 9] and all(type(t) is int for t in p.stop_token_ids)
    assert p.logit_bias == {2: 1.5}
    with pytest.raises(ValueError, match="max_tokens must be None or an int >= 1, got 0"):
        P(max_tokens=np.int64(0))
    with pytest.raises(ValueError, match="top_k must be"):
        P(top_k=np.float64(2.5))


def test_greedy_switches_filters_off():
    p = P(temperature=1e-6, top_k=5, top_p=0.5, min_p=0.2)
    assert p.is_greedy and (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_stop_token_ids_include_eos_unless_ignore_eos():
    assert P(stop_token_ids=[5]).all_stop_token_ids([2]) == {2, 5}
    assert P(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids([2]) == {5}


def test_clone_validates_and_does_not_share_lists():
    p = P(stop=["a"], seed=1)
    child = p.clone(seed=2)
    child.stop.append("b")
    assert p.stop == ["a"] and child.seed == 2
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-0.5)


def test_host_side_modules_do_not_import_jax():
    code = "import sys, jengine.sampling_params, jengine.detokenizer; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(beam_width=True), "beam_width must be an int"),
    (dict(beam_width=11), r"beam_width must be an int in \[1, 10\]"),
    (dict(max_tokens=2.0), "max_tokens must be an int >= 1"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(temperature="0"), "temperature must be finite and >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite and >= 0"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(length_penalty="1"), "length_penalty must be a finite number"),
])
def test_beam_search_params_name_the_bad_field(kwargs, message):
    from jengine.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
