"""`tollway batch submit|list|status|cancel|download`: batch jobs through a gateway's HTTP API.

Every command speaks to the gateway (`--gateway-url`, TOLLWAY_GATEWAY_URL, default
http://127.0.0.1:8000) with a tenant API key (`--api-key` or TOLLWAY_API_KEY), exactly as the
`openai` SDK would. An error answer or an unreachable gateway exits 1 with the message on stderr.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

ERROR_EXIT_CODE = 1
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


def _stderr() -> Console:
    return Console(stderr=True, soft_wrap=True)  # messages hold paths and ids: never wrapped


def fail(message: str) -> NoReturn:
    _stderr().print(f"[red]error:[/] {escape(message)}")
    sys.exit(ERROR_EXIT_CODE)


class Gateway:
    """The few calls the CLI makes, over urllib (the gateway answers OpenAI error objects)."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url, self.api_key = url.rstrip("/"), api_key

    def call(self, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", data=body, method=method, headers={
            "Authorization": f"Bearer {self.api_key}", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            fail(f"{method} {path}: HTTP {exc.code}: {message}")
        except (urllib.error.URLError, OSError) as exc:
            fail(f"cannot reach the gateway at {self.url}: {getattr(exc, 'reason', exc)}")

    def json(self, method: str, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        return json.loads(self.call(method, path, None if payload is None else json.dumps(payload).encode()))

    def upload(self, path: Path) -> dict[str, Any]:
        boundary = uuid.uuid4().hex
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode()
        body = head + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        return json.loads(self.call("POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}"))


def first_url(path: Path) -> str:
    """The url of the file's first request (every line of a batch input uses the same one)."""
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                return url if isinstance(url, str) else "/v1/chat/completions"
    return "/v1/chat/completions"


def save_files(gateway: Gateway, batch: dict[str, Any], output_dir: Path) -> list[Path]:
    """Download the batch's output and error files into `output_dir`; the paths written."""
    saved = []
    output_dir.mkdir(parents=True, exist_ok=True)
    for field, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        if batch.get(field):
            target = output_dir / f"{batch['id']}_{suffix}.jsonl"
            target.write_bytes(gateway.call("GET", f"/v1/files/{batch[field]}/content"))
            saved.append(target)
    return saved


def _counts(batch: dict[str, Any]) -> str:
    counts = batch["request_counts"]
    return f"{counts['completed']} completed, {counts['failed']} failed / {counts['total']}"


def wait_with_progress(gateway: Gateway, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch ends, with a live bar: completed / failed / total and tokens/s."""
    started = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[counts]}"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn())
    with Progress(*columns, console=_stderr(), transient=False) as progress:
        task = progress.add_task(batch["status"], total=batch["request_counts"]["total"] or 1,
                                 counts=_counts(batch), rate="")
        while batch["status"] not in ENDED:
            time.sleep(POLL_S)
            batch = gateway.json("GET", f"/v1/batches/{batch['id']}")
            counts = batch["request_counts"]
            tokens = (batch.get("usage") or {}).get("total_tokens", 0)
            rate = tokens / max(time.monotonic() - started, 1e-6)
            progress.update(task, description=batch["status"], completed=counts["completed"] + counts["failed"],
                            total=counts["total"] or 1, counts=_counts(batch), rate=f"{rate:,.0f} tokens/s")
    return batch


def describe(batch: dict[str, Any]) -> str:
    lines = [f"{batch['id']}: {batch['status']} ({_counts(batch)})"]
    for item in (batch.get("errors") or {}).get("data") or []:
        where = f"line {item['line']}: " if item.get("line") and not item["message"].startswith("line") else ""
        lines.append(f"  error {item.get('code')}: {where}{item['message']}")
    return "\n".join(lines)


api_key_option = click.option("--api-key", envvar="TOLLWAY_API_KEY", required=True,
                              help="A tenant API key (tw-…) [env: TOLLWAY_API_KEY].")
gateway_option = click.option("--gateway-url", envvar="TOLLWAY_GATEWAY_URL", default="http://127.0.0.1:8000",
                              show_default=True, help="The gateway [env: TOLLWAY_GATEWAY_URL].")


@click.group()
def batch() -> None:
    """Asynchronous batch jobs (OpenAI's Batches API) through a gateway."""


@batch.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@api_key_option
@gateway_option
@click.option("--wait", is_flag=True, help="Show a live progress bar until the batch ends, then save its files.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Where --wait saves the output and error files.")
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", help="Batch metadata (repeatable).")
def submit(file: Path, api_key: str, gateway_url: str, wait: bool, output_dir: Path, metadata: tuple[str, ...]) -> None:
    """Upload FILE (JSONL requests), create a batch from it and print its id."""
    pairs = dict(item.split("=", 1) for item in metadata if "=" in item)
    if len(pairs) != len(metadata):
        raise click.BadParameter("use KEY=VALUE", param_hint="--metadata")
    gateway = Gateway(gateway_url, api_key)
    uploaded = gateway.upload(file)
    created = gateway.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": first_url(file),
                                                   "completion_window": "24h", "metadata": pairs or None})
    _stderr().print(f"uploaded {file} as {uploaded['id']}; batch {created['id']} is {created['status']}")
    click.echo(created["id"])
    if not wait:
        return
    try:
        done = wait_with_progress(gateway, created)
    except KeyboardInterrupt:
        fail(f"stopped waiting; the batch goes on: `tollway batch status {created['id']}`")
    _stderr().print(describe(done))
    for path in save_files(gateway, done, output_dir):
        _stderr().print(f"saved {path}")
    if done["status"] != "completed":
        sys.exit(ERROR_EXIT_CODE)


@batch.command("list")
@api_key_option
@gateway_option
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
def list_command(api_key: str, gateway_url: str, limit: int) -> None:
    """List your batches, newest first."""
    page = Gateway(gateway_url, api_key).json("GET", f"/v1/batches?limit={limit}")
    for item in page["data"]:  # one plain line per batch: easy to read and to grep
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(item["created_at"]))
        click.echo(f"{item['id']}  {item['status']:<11}  {_counts(item)}  created {created} UTC")


@batch.command("status")
@click.argument("batch_id")
@api_key_option
@gateway_option
@click.option("--json", "as_json", is_flag=True, help="Print the whole batch object.")
def status(batch_id: str, api_key: str, gateway_url: str, as_json: bool) -> None:
    """Show a batch's status and request counts."""
    found = Gateway(gateway_url, api_key).json("GET", f"/v1/batches/{batch_id}")
    click.echo(json.dumps(found, indent=2) if as_json else describe(found))


@batch.command("cancel")
@click.argument("batch_id")
@api_key_option
@gateway_option
def cancel(batch_id: str, api_key: str, gateway_url: str) -> None:
    """Cancel a batch: lines in flight finish, the others are not run."""
    click.echo(describe(Gateway(gateway_url, api_key).json("POST", f"/v1/batches/{batch_id}/cancel")))


@batch.command("download")
@click.argument("batch_id")
@api_key_option
@gateway_option
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True)
def download(batch_id: str, api_key: str, gateway_url: str, output_dir: Path) -> None:
    """Save a batch's output and error files (BATCH_ID_output.jsonl, BATCH_ID_errors.jsonl)."""
    gateway = Gateway(gateway_url, api_key)
    found = gateway.json("GET", f"/v1/batches/{batch_id}")
    saved = save_files(gateway, found, output_dir)
    if not saved:
        fail(f"batch {batch_id} has no files yet (it is {found['status']})")
    for path in saved:
        click.echo(str(path))
