"""The server's parts tested in this process, with no server running: the `serve` CLI's flags, a stream's
accumulation of the engine's delta outputs, and the parameter an error body names."""

from __future__ import annotations

import pytest
from test_server_harness import MODEL


def test_serve_cli_binds_loopback_by_default_and_checks_tensor_parallel_size_against_devices():
    from jengine.cli import build_parser

    args = build_parser().parse_args(["serve", MODEL])
    assert (args.host, args.port, args.tensor_parallel_size) == ("127.0.0.1", 8000, 1)
    args = build_parser().parse_args(["serve", MODEL, "--tensor-parallel-size", "2"])  # this process has 1 device
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the number of devices \(1\)"):
        args.func(args)


def test_serve_cli_bucket_lists_take_commas_or_spaces_and_reject_other_text(capsys):
    from jengine.cli import build_parser
    from jengine.entrypoints.serve import _joined

    parser = build_parser()
    args = parser.parse_args(["serve", MODEL, "--token-buckets", "16,64", "256", "--seq-buckets", "8", "32"])
    assert (_joined(args.token_buckets), _joined(args.seq_buckets)) == ((16, 64, 256), (8, 32))
    assert _joined(parser.parse_args(["serve", MODEL]).token_buckets) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", MODEL, "--token-buckets", "16,many"])
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_a_stream_accumulates_the_engines_delta_outputs():
    from jengine.entrypoints.openai_serving import _accumulate
    from jengine.outputs import CompletionOutput, RequestOutput
    from jengine.request import RequestMetrics

    def out(text, ids, finish=None, prompt_logprobs=None):
        choice = CompletionOutput(0, text, ids, -1.0 * len(ids), [{i: None} for i in ids], finish)
        return RequestOutput("r", "p", [1, 2], [choice], finish is not None, RequestMetrics(0.0), prompt_logprobs)

    acc = _accumulate(None, out("He", [5], prompt_logprobs=[None, {2: None}]))
    acc = _accumulate(acc, out("llo", [6, 7]))
    acc = _accumulate(acc, out("", [8], finish="length"))
    c = acc.outputs[0]
    assert (c.text, c.token_ids, len(c.logprobs), c.finish_reason) == ("Hello", [5, 6, 7, 8], 4, "length")
    assert acc.finished and acc.prompt_logprobs == [None, {2: None}] and c.cumulative_logprob == -1.0


@pytest.mark.parametrize("message,param", [
    ("top_p must be in (0, 1], got 2", "top_p"), ("logit_bias[7] must be a number, got 'x'", "logit_bias"),
    ("send exactly one of 'prompt' or 'messages'", None), ("this model has no tokenizer; send token ids", None),
    ("n", "n"), ("", None), ("Temperature must be >= 0", None),
])
def test_named_param(message, param):
    from jengine.entrypoints.errors import named_param

    assert named_param(message) == param
