"""`draftsmith` command line: inspect and check the config (the pipeline itself runs through
`dvc repro`; each stage is also runnable alone as `python -m stages.<name>`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
import yaml

from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError

app = typer.Typer(help="Draftsmith: train EAGLE-3, EAGLE-3.1 and DFlash drafters with a reproducible DVC pipeline.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
config_app = typer.Typer(help="Inspect and validate params.yaml.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ParamsOpt = typer.Option(Path("params.yaml"), "--params", "-p", help="parameters file")
SetOpt = typer.Option(None, "--set", "-s", help="override, e.g. -s generate.num_samples=10")


def _load(params: Path, overrides: list[str] | None):
    try:
        return load_config(params, overrides or [])
    except DraftsmithError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def config_show(params: Path = ParamsOpt, set_: list[str] = SetOpt,
                section: str = typer.Argument(None, help="print only this section")):
    """Print the resolved, validated config (defaults filled in, overrides applied)."""
    cfg = _load(params, set_).model_dump()
    if section:
        if section not in cfg:
            typer.echo(f"error: no section '{section}' (sections: {', '.join(cfg)})", err=True)
            raise typer.Exit(2)
        cfg = {section: cfg[section]}
    yaml.safe_dump(cfg, sys.stdout, sort_keys=False)


@config_app.command("check")
def config_check(params: Path = ParamsOpt, set_: list[str] = SetOpt):
    """Validate params.yaml; exit 2 with an explanation if anything is wrong."""
    _load(params, set_)
    typer.echo(f"{params}: ok")


@config_app.command("preset")
def config_preset(presets: list[Path] = typer.Argument(..., help="presets, e.g. presets/h200.yaml "
                                                                 "(later ones win)"),
                  params: Path = ParamsOpt):
    """Write presets' values into params.yaml in place (comments and other keys kept; each
    validated first). `git diff params.yaml` shows what changed; `dvc repro` reruns what it
    touched."""
    from draftsmith.presets import apply_file

    for preset in presets:
        try:
            keys = apply_file(preset, params)
        except (DraftsmithError, OSError, yaml.YAMLError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{params}: {len(keys)} values from {preset}: {', '.join(keys)}")


@app.command("validate")
def validate_export(export_dir: Path = typer.Argument(..., help="an engine export, e.g. models/export/vllm"),
                    target: Path = typer.Option(Path("models/target"), help="target artifact")):
    """Check a drafter export of any method (keys, shapes, dtypes, d2t offsets, aux layer ids,
    the method's own flags) against the target; exit 2 naming every problem."""
    from draftsmith.export import validate
    from draftsmith.target_info import read_info

    try:
        info = read_info(target)
        summary = validate(export_dir, target_num_layers=info.num_layers,
                           target_hidden_size=info.hidden_size, target_vocab_size=info.vocab_size)
    except DraftsmithError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{export_dir}: ok {summary}")


@app.command("metrics")
def metrics(metrics_dir: Path = typer.Argument(Path("metrics"), help="the stages' metrics folder")):
    """One line a stage: the figures to look at after `dvc repro` (every key: `dvc metrics
    show`; between commits: `dvc metrics diff`)."""
    from draftsmith.summary import lines

    try:
        typer.echo("\n".join(lines(metrics_dir)))
    except DraftsmithError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo("\nplots: plots/train.png, plots/acceptance.png (`dvc plots show`); the drafter: "
               "models/export/vllm and models/export/sglang")


if __name__ == "__main__":
    app()
