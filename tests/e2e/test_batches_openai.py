"""The real `openai` SDK's Files and Batches API against `tollway up` (gateway, engine worker and the
Celery batch worker on the embedded SQLite broker) with the default model: a 200-line batch end to
end, each custom_id exactly once in the output, each line billed once as a batch request."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.tollway_up import start_tollway

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
LINES = 200


def test_a_200_line_batch_through_the_openai_sdk(smollm2_folder: Path, model_home: Path, tmp_path: Path) -> None:
    tollway = start_tollway(tmp_path / "home", model_home, TOLLWAY_DTYPE="float32")
    try:
        client = openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("acme"), max_retries=0)
        requests = [{"custom_id": f"question-{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": MODEL, "max_tokens": 4, "temperature": 0,
                              "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]}}
                    for i in range(LINES)]
        data = "".join(json.dumps(r) + "\n" for r in requests).encode()
        uploaded = client.files.create(file=("questions.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"suite": "e2e"})
        assert batch.status == "validating" and batch.request_counts.total == LINES

        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status}; logs in {tollway.home / 'logs'}"
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == LINES and batch.request_counts.failed == 0
        assert batch.error_file_id is None and batch.metadata == {"suite": "e2e"}
        assert batch.completed_at >= batch.finalizing_at >= batch.in_progress_at >= batch.created_at

        lines = [json.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines()]
        assert sorted(line["custom_id"] for line in lines) == sorted(r["custom_id"] for r in requests)
        for line in lines:
            body = line["response"]["body"]
            assert line["error"] is None and line["response"]["status_code"] == 200
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
            assert body["choices"][0]["message"]["content"]
        assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

        with sqlite3.connect(tollway.home / "tollway.db") as db:
            rows = db.execute("SELECT request_id, status FROM usage_events WHERE batch_id = ?", (batch.id,)).fetchall()
        assert sorted(r[0] for r in rows) == sorted(line["response"]["request_id"] for line in lines)
        assert {r[1] for r in rows} == {"ok"}
        assert (tollway.home / "logs" / "batch-worker.log").exists()
        # queued on the embedded broker when created, not left for the sweep to find (up to 30 s later)
        assert "could not queue batch" not in (tollway.home / "logs" / "gateway.log").read_text()
    finally:
        tollway.stop()
