"""deploy/two-models/: the models file and the tenants file shipped as the example parse as
the router reads them, and its README's command line is one the router accepts."""

from __future__ import annotations

from router.models import parse_models
from router.tenants.config import parse
from tests.commands import commands, shell_blocks
from tests.deploy.manifests import DEPLOY, router_args

EXAMPLE = DEPLOY / "two-models"


def test_the_models_file_names_two_models_with_their_workers() -> None:
    models = parse_models((EXAMPLE / "models.toml").read_text(), "models.toml", check_paths=False)
    assert [m.name for m in models] == ["llama", "qwen"]
    assert all(m.tokenizer_path and m.worker_urls for m in models)


def test_the_tenants_file_names_two_tenants_and_a_public_prefix() -> None:
    tenants = parse((EXAMPLE / "tenants.toml").read_text(), "tenants.toml")
    assert sorted(tenants.tenants) == ["acme", "globex"]
    assert len(tenants.public) == 1


def test_the_readme_command_is_accepted_and_names_both_files() -> None:
    shown = [
        list(c.args)
        for c in commands(shell_blocks((EXAMPLE / "README.md").read_text()))
        if c.kind == "module" and c.target == "router"
    ]
    assert len(shown) == 1
    args = router_args(shown[0])
    assert args.models == "deploy/two-models/models.toml"
    assert args.tenants == "deploy/two-models/tenants.toml"
