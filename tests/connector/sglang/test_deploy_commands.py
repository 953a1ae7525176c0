"""deploy/sglang-hicache.md's command lines hold together: every SGLang flag exists in
SGLang 0.5.23, every extra-config JSON is accepted by SGLang's dynamic loader keys and by our
backend's parser, decodes push to a prefill that listens there, and the router's own parser
accepts the router line."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from connector.sglang.config import BackendConfig
from connector.sglang.cpu_paths import sglang_file
from router.__main__ import build_parser, pd_workers

DOC = Path(__file__).resolve().parents[3] / "deploy" / "sglang-hicache.md"


def commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    out = []
    for block in blocks:
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.strip().startswith("python -m"):
                out.append(shlex.split(cmd))
    return out


def sglang_flags() -> set[str]:
    """SGLang 0.5.23's server flags: its argument fields, spelled as it spells flags."""
    fields = sglang_file("srt/arg_groups/fields")
    names = set()
    for path in fields.glob("*.py"):
        names |= set(re.findall(r"^    ([a-z][a-z0-9_]*): A\[", path.read_text(), re.M))
    return {"--" + n.replace("_", "-") for n in names}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_command_lines_use_real_flags_and_valid_configs() -> None:
    cmds = [c for c in commands() if c[2] == "sglang.launch_server"]
    assert len(cmds) == 2
    known = sglang_flags()
    configs = {}
    for argv in cmds:
        used = [a for a in argv if a.startswith("--")]
        assert set(used) <= known, set(used) - known
        extra = json.loads(value(argv, "--hicache-storage-backend-extra-config"))
        assert extra["module_path"] == "connector.sglang.backend"
        assert extra["class_name"] == "MemPoolStorage" and extra["interface_v1"] == 1
        cfg = BackendConfig.from_extra(extra)
        assert cfg.page_size == int(value(argv, "--page-size"))
        json.loads(value(argv, "--kv-events-config"))
        configs[value(argv, "--disaggregation-mode")] = cfg
    prefill, decode = configs["prefill"], configs["decode"]
    assert [(p.instance_id, p.host, p.port) for p in decode.writeback_peers] == [
        (prefill.instance_id, prefill.host, prefill.port)
    ]
    assert not prefill.writeback_peers and decode.secret == prefill.secret


def test_router_command_line_parses() -> None:
    (argv,) = [c for c in commands() if c[2] == "router"]
    args = build_parser().parse_args(argv[3:])
    prefills, decodes = pd_workers(args)
    assert prefills == [("http://10.0.0.1:30001", 8998)]
    assert decodes == ["http://10.0.0.2:30002"]
    assert args.pd_caching == "caching-3" and args.page_size == 64
