"""The Prefect and MLflow UIs, started as the README says: the servers answer, `prefect --no-prompt deploy --all`
registers the scheduled deployment, a worker runs a deployment run, and headless Chromium renders the pages with
their data (not an empty shell or an error page).

Screenshots go to $TRACE_UI_SHOTS when set (to look at them), else to pytest's temporary folder. Each UI test starts
a real server (10-40 s on two cores) and several browsers, hence `slow`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import browser

ROOT = Path(__file__).resolve().parents[1]
# The commands a user is told to run: the README and the running guide it links (docs/running.md).
README = (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs" / "running.md").read_text()
BIN = Path(sys.executable).parent
SETTLE_MS = 15_000  # virtual time for the single-page apps to fetch their data and render
CAPABILITY = "tool_call_precision"

# What the README tells a user to run (checked to be there verbatim, then run here).
WORK_POOL = "prefect work-pool create trace-local --type process --overwrite"
DEPLOY = "prefect --no-prompt deploy --all"
WORKER = "prefect worker start --pool trace-local --run-once"


# ------------------------------------------------------------------------------------------------- helpers
def _readme_command(prefix: str) -> list[str]:
    """The first command line in the README's code blocks that starts with `prefix` (comments dropped)."""
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        for line in block.splitlines():
            if line.strip().startswith(prefix):
                return shlex.split(line, comments=True)
    raise AssertionError(f"README.md and docs/running.md have no `{prefix} ...` command in a bash block")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(DO_NOT_TRACK="true", PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true",
               LITELLM_LOCAL_MODEL_COST_MAP="True", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.update(extra)
    return env


def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # loopback only
        return response.read()


def _post(url: str, body: dict) -> object:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:  # loopback only
        return json.loads(response.read())


class Server:
    """A server process in its own process group (so its workers go with it), its log in a file."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str], log: Path):
        self.cmd, self.log = cmd, log
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_http(self, url: str, timeout_s: float = 240) -> float:
        """Seconds until `url` answered 200; fails with the log's tail if the process dies or time runs out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"{' '.join(self.cmd)} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                _get(url, timeout=5)
                return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        pytest.fail(f"{url} did not answer within {timeout_s}s ({' '.join(self.cmd)}):\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _cli(cmd: str | list[str], env: dict[str, str], timeout_s: float = 300) -> str:
    args = shlex.split(cmd) if isinstance(cmd, str) else cmd
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{output}"
    return proc.stdout + proc.stderr


def _rendered(png: Path) -> None:
    width, height, colours = browser.png_summary(png)
    assert (width, height) == (1280, 1600)
    assert colours > 50, f"{png} looks blank ({colours} colours)"


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("TRACE_UI_SHOTS") or tmp_path_factory.mktemp("ui-shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ------------------------------------------------------------------------------------------ README (fast)
def test_readme_ui_commands_match_the_project():
    from trace_core.config import load_params

    params = load_params(ROOT / "params.yaml")
    mlflow_ui = _readme_command("mlflow ui")
    assert mlflow_ui[mlflow_ui.index("--backend-store-uri") + 1] == params.tracking.mlflow_uri
    assert _readme_command("prefect server start")
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    for cmd in (WORK_POOL, DEPLOY, WORKER, "prefect deployment run trace-pipeline/local"):
        assert cmd in README, f"README.md / docs/running.md no longer say `{cmd}`"
    assert f"--pool {deployment['work_pool']['name']}" in WORKER
    assert "PREFECT_SERVER_API_PORT" in README  # how to move the server (and its UI's API address) off 4200


# ------------------------------------------------------------------------------------------------- Prefect
@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    browser.require_chromium()
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    # The README's other-port recipe: the UI asks its API at PREFECT_SERVER_API_PORT (`--port` alone keeps 4200).
    env = _env(PREFECT_HOME=str(home), PREFECT_SERVER_API_PORT=str(port), PREFECT_SERVER_API_HOST="127.0.0.1")
    server = Server(_readme_command("prefect server start"), ROOT, env, home / "server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"prefect server up after {server.wait_http(url + '/api/health'):.0f}s")
        client_env = _env(PREFECT_HOME=str(home), PREFECT_API_URL=f"{url}/api")
        yield url, client_env
    finally:
        server.stop()


@pytest.mark.slow
def test_prefect_deploy_worker_and_ui(prefect_server, shots, tmp_path):
    url, env = prefect_server
    assert json.loads(_get(f"{url}/ui-settings"))["api_url"] == f"{url}/api"  # the UI talks to this server

    # Deploy as the README says; the weekly schedule is registered with it.
    _cli(WORK_POOL, env)
    _cli(DEPLOY, env)
    deployment = json.loads(_get(f"{url}/api/deployments/name/trace-pipeline/local"))
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]
    (schedule,) = deployment["schedules"]
    assert schedule["active"] and schedule["schedule"]["cron"] == spec["schedules"][0]["cron"]
    assert deployment["work_pool_name"] == "trace-local" and deployment["description"] == spec["description"]
    upcoming = {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]},
                              "state": {"type": {"any_": ["SCHEDULED"]}}}}
    deadline = time.monotonic() + 120  # the server's scheduler adds the upcoming runs in the background
    while not (scheduled := _post(f"{url}/api/flow_runs/filter", upcoming)) and time.monotonic() < deadline:
        time.sleep(2)
    assert scheduled, "the schedule created no upcoming runs within 120 s"
    assert all(r["expected_start_time"] > deployment["created"] for r in scheduled)

    # A cheap deployment run (stage synthesis of a capability analysis did not select; outputs and MLflow store in
    # tmp), executed by the README's one-shot worker in this folder.
    from trace_core.schemas import CapabilityDictionary

    (tmp_path / "analysis").mkdir()
    empty = CapabilityDictionary(target={}, thresholds={}, labellers=["programmatic"], selected=[], capabilities=[])
    (tmp_path / "analysis" / "capabilities.json").write_text(empty.model_dump_json())
    overrides = {"analysis.out_dir": str(tmp_path / "analysis"), "synthesis.out_dir": str(tmp_path / "synthesis"),
                 "tracking.mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                 "tracking.artifact_root": str(tmp_path / "mlartifacts")}
    created = _cli(["prefect", "deployment", "run", "trace-pipeline/local", "--param", "stage=synthesis",
                    "--param", f"capability={CAPABILITY}", "--params", json.dumps({"overrides": overrides})], env)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", created).group(1)
    worker = _cli(WORKER, env, timeout_s=400)
    flow_run = json.loads(_get(f"{url}/api/flow_runs/{run_id}"))
    assert flow_run["state_type"] == "COMPLETED", worker[-4000:]
    spec_json = json.loads((tmp_path / "synthesis" / CAPABILITY / "spec.json").read_text())
    assert spec_json["status"] == "not_selected"

    # The UI: the deployment list and the finished run, rendered with their data.
    pages = {"prefect-deployments": "/deployments", "prefect-flow-run": f"/runs/flow-run/{run_id}"}
    for name, path in pages.items():
        _rendered(browser.screenshot(url + path, shots / f"{name}.png", settle_ms=SETTLE_MS, timeout_s=120))
    dom = browser.dump_dom(url + "/deployments", settle_ms=SETTLE_MS, timeout_s=120)
    assert "Prefect Server" in dom and "trace-pipeline" in dom and "local" in dom
    assert "Can't connect to Server API" not in dom
    dom = browser.dump_dom(url + f"/runs/flow-run/{run_id}", settle_ms=SETTLE_MS, timeout_s=120)
    assert flow_run["name"] in dom and "Completed" in dom


# -------------------------------------------------------------------------------------------------- MLflow
@pytest.fixture(scope="module")
def mlflow_project(tmp_path_factory) -> tuple[Path, str]:
    """A project whose MLflow store holds an evaluation run and model trace-<capability> with a candidate version
    promoted to champion (the version points at an empty folder: the UI only lists it)."""
    from tasks import tracking
    from trace_core.config import load_params

    project = tmp_path_factory.mktemp("mlflow-ui-project")
    (project / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    params = load_params(project / "params.yaml")
    with tracking.stage_run("evaluation", params, root=project) as run:
        run.log_metrics({"trace": {"pass^1": 0.5}, "base": {"pass^1": 0.25}})
    client = run.client
    name = tracking.model_name(CAPABILITY)
    client.create_registered_model(name)
    (project / "adapter").mkdir()
    version = client.create_model_version(name, (project / "adapter").as_uri(), run_id=run.run_id,
                                          tags={tracking.ADAPTER_SHA_TAG: "ab" * 32})
    client.set_registered_model_alias(name, tracking.CANDIDATE, version.version)
    tracking.promote_champion(client, CAPABILITY, "ab" * 32)
    return project, name


@pytest.fixture(scope="module")
def mlflow_server(mlflow_project) -> Iterator[str]:
    browser.require_chromium()
    project, _ = mlflow_project
    cmd = _readme_command("mlflow ui")
    port = _free_port()
    cmd[cmd.index("--port") + 1] = str(port)
    server = Server(cmd, project, _env(), project / "mlflow-ui.log")  # run from the project root, as the README
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"mlflow ui up after {server.wait_http(url + '/health'):.0f}s")
        yield url
    finally:
        server.stop()


@pytest.mark.slow
def test_mlflow_ui_shows_the_registry_and_the_runs(mlflow_project, mlflow_server, shots):
    _, name = mlflow_project
    url = mlflow_server
    pages = {"mlflow-models": "/#/models", "mlflow-model": f"/#/models/{name}", "mlflow-experiments": "/#/experiments"}
    for page, path in pages.items():
        _rendered(browser.screenshot(url + path, shots / f"{page}.png", settle_ms=SETTLE_MS, timeout_s=120))
    dom = browser.dump_dom(url + f"/#/models/{name}", settle_ms=SETTLE_MS, timeout_s=120)
    assert "<title>MLflow" in dom and name in dom
    assert "champion" in dom and "candidate" in dom
    dom = browser.dump_dom(url + "/#/experiments", settle_ms=SETTLE_MS, timeout_s=120)
    assert "trace-evaluation" in dom
