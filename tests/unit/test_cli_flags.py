"""A flag ``gpuserve`` does not know: the nearest one it has ("did you mean", as config keys
get), or for a tritonserver flag the gpuserve setting that does the same; exit status 2, one
line per unknown flag, before anything runs."""

from __future__ import annotations

import pytest

from gpuserve.cli.flags import TRITON_FLAGS
from gpuserve.cli.main import build_parser, main, subcommand_parser


@pytest.fixture(autouse=True)
def never_serve(monkeypatch):
    """A command line these tests think refused must not start a server instead."""

    def run(args):
        raise AssertionError(f"gpuserve serve would have run with {args}")

    monkeypatch.setattr("gpuserve.cli.serve.run", run)


def refused(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_mistyped_flag_gets_the_nearest_one(capsys):
    assert refused(capsys, "serve", "--http-prot", "9000") == [
        "gpuserve serve: unknown flag '--http-prot'; did you mean '--http-port'?"
    ]
    assert refused(capsys, "--model-contrl-mode=poll") == [  # `gpuserve --flag` serves
        "gpuserve serve: unknown flag '--model-contrl-mode'; did you mean '--model-control-mode'?"
    ]
    (line,) = refused(capsys, "bench", "--concurency", "4")
    assert line.endswith("did you mean '--concurrency'?")
    (line,) = refused(capsys, "serve", "--zzzz")
    assert line == "gpuserve serve: unknown flag '--zzzz' (see gpuserve serve --help)"


def test_every_unknown_flag_and_stray_argument_is_named_at_once(capsys):
    lines = refused(capsys, "serve", "--http-prot", "1", "--grpc-prot=2", "stray")
    assert len(lines) == 3
    assert "'--http-prot'" in lines[0] and "'--grpc-prot'" in lines[1]
    assert lines[2] == "gpuserve serve: unexpected argument 'stray' (see gpuserve serve --help)"


@pytest.mark.parametrize(
    ("triton", "equivalent"),
    [
        ("--log-verbose=1", "--log-level debug"),
        ("--repository-poll-secs", "--repository-poll-interval-s"),
        ("--exit-timeout-secs", "--shutdown-timeout-s"),
        ("--allow-grpc=false", "--grpc-port -1"),
        ("--allow-metrics", "--metrics-port -1"),
        ("--model-store", "--model-repository"),
    ],
)
def test_tritons_flags_are_named_with_the_gpuserve_equivalent(capsys, triton, equivalent):
    value = [] if "=" in triton else ["5"]
    (line,) = refused(capsys, "serve", triton, *value)
    name = triton.split("=")[0]
    assert line.startswith(f"gpuserve serve: '{name}' is tritonserver's; gpuserve serve uses ")
    assert equivalent in line


def test_tritons_flags_of_the_same_name_are_taken_as_they_are():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--model-repository=/models", "--http-port=8000", "--grpc-port=8001",
         "--metrics-port=8002", "--model-control-mode=explicit", "--load-model=a"]
    )  # fmt: skip
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)
    assert args.model_control_mode == "explicit" and args.load_model == ["a"]


def test_the_triton_table_names_no_flag_gpuserve_serve_has():
    serve = subcommand_parser(build_parser(), "serve")
    own = {o for a in serve._actions for o in a.option_strings}
    assert own.isdisjoint(TRITON_FLAGS), own & set(TRITON_FLAGS)
    for equivalent in TRITON_FLAGS.values():
        for word in equivalent.split():
            if word.startswith("--"):
                assert word in own, f"{word} is not a gpuserve serve flag"
