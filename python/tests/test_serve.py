"""python -m colibri.serve against the real OpenAI client on loopback: a
server process on a small Qwen3-MoE GGUF (with its byte-level BPE
tokenizer), chat and completions, streaming and not, concurrent clients
batched, a client that disconnects, bad requests, /metrics."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
prom_parser = pytest.importorskip("prometheus_client.parser")

sys.path.insert(0, os.path.dirname(__file__))
from test_from_pretrained import write  # noqa: E402

CONTEXT = 256


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


def _post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = write(tmp_path_factory.mktemp("serve"), "qwen3moe")
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..")] +
                                        [env.get("PYTHONPATH", "")] if p)
    log = open(str(tmp_path_factory.mktemp("log") / "server.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.serve", path, "--port", str(port), "--threads", "2",
                             "--max-batch", "4", "--ctx-size", str(CONTEXT), "--name", "tiny-qwen3"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = "http://127.0.0.1:%d" % port
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail("the server exited (%s):\n%s" % (proc.returncode, log.read()[-4000:]))
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("the server did not answer /health in 180 s")
            time.sleep(0.2)
        yield base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        text = log.read()
        log.close()
        assert "Traceback" not in text, text[-4000:]


def _metrics(base):
    families = {f.name: f for f in prom_parser.text_string_to_metric_families(_get(base + "/metrics")[1])}
    return families


def _value(families, family, sample, **labels):
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def test_models_and_health(server):
    base, client = server
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3"]
    status, body = _get(base + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat_streaming_and_not_agree(server):
    _, client = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "tell me a story"}]
    whole = client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=20, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens == (20 if choice.finish_reason == "length" else whole.usage.completion_tokens)
    assert whole.usage.prompt_tokens > 10 and whole.object == "chat.completion"
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=20,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == choice.message.content and finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_text_and_token_prompts(server):
    _, client = server
    by_text = client.completions.create(model="tiny-qwen3", prompt="hello world", max_tokens=8, temperature=0)
    assert by_text.usage.prompt_tokens == 9 and by_text.object == "text_completion"
    # The same prompt as token ids (what the tokenizer gives "hello world").
    ids = [104, 291, 108, 111, 273, 111, 114, 108, 100]
    by_ids = client.completions.create(model="tiny-qwen3", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-qwen3", prompt=ids, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text
    # Seeded sampling repeats itself.
    a, b = (client.completions.create(model="tiny-qwen3", prompt=ids, max_tokens=12, temperature=0.8, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_concurrent_clients_are_batched_and_get_their_sequential_output(server):
    """Four clients at once get, token for token, what each got alone, and
    the engine's decode steps held several sequences (the batch-size
    histogram's sum exceeds its count)."""
    base, client = server
    prompts = ["the cat sat", "on a mat and then", "why", "tell me about the weather in the hills"]

    def ask(prompt):
        r = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=48, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    alone = [ask(p) for p in prompts]
    before = _metrics(base)
    rows0 = _value(before, "colibri_decode_batch_size", "colibri_decode_batch_size_sum")
    steps0 = _value(before, "colibri_decode_batch_size", "colibri_decode_batch_size_count")
    together = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def client_thread(i):
        start.wait()
        together[i] = ask(prompts[i])

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    after = _metrics(base)
    rows = _value(after, "colibri_decode_batch_size", "colibri_decode_batch_size_sum") - rows0
    steps = _value(after, "colibri_decode_batch_size", "colibri_decode_batch_size_count") - steps0
    assert rows > steps, (rows, steps)


def test_a_disconnecting_client_frees_its_slot(server):
    base, _ = server
    body = json.dumps({"model": "tiny-qwen3", "prompt": "go on", "max_tokens": CONTEXT - 10, "temperature": 0,
                       "stream": True}).encode()
    host, port = base[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
    cancelled = None
    deadline = time.time() + 60
    while time.time() < deadline:
        running = json.loads(_get(base + "/health")[1])["running"]
        cancelled = _value(_metrics(base), "colibri_requests_finished", "colibri_requests_finished_total",
                           reason="cancelled")
        if running == 0 and cancelled:
            break
        time.sleep(0.1)
    assert running == 0 and cancelled >= 1, (running, cancelled)


def test_bad_requests_get_openai_errors(server):
    base, client = server
    url = base + "/v1/completions"
    status, body = _post(url, b"{not json", raw=True)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(url, {"prompt": "x", "temperature": "hot"})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = _post(url, {"max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = _post(url, {"prompt": [1, 2, 99999]})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    status, body = _post(url, {"prompt": "x", "n": 2})
    assert status == 400 and body["error"]["param"] == "n"
    status, body = _post(base + "/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-qwen3", prompt="hello", max_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded" and "exceed the context of %d" % CONTEXT in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt="hello", max_tokens=2)
    # The server still answers.
    assert client.completions.create(model="tiny-qwen3", prompt="ok", max_tokens=2, temperature=0).choices


def test_metrics_parse_and_count(server):
    base, client = server
    client.completions.create(model="tiny-qwen3", prompt="count me", max_tokens=5, temperature=0)
    families = _metrics(base)
    for name in ("colibri_requests", "colibri_prompt_tokens", "colibri_generation_tokens",
                 "colibri_time_to_first_token_seconds", "colibri_inter_token_latency_seconds",
                 "colibri_decode_batch_size", "colibri_library_infer_calls", "colibri_library_bytes_mapped",
                 "colibri_kernels_info", "colibri_requests_running"):
        assert name in families, (name, sorted(families))
    assert _value(families, "colibri_requests", "colibri_requests_total", endpoint="/v1/completions",
                  status="200") >= 1
    assert _value(families, "colibri_generation_tokens", "colibri_generation_tokens_total") >= 5
    assert _value(families, "colibri_time_to_first_token_seconds",
                  "colibri_time_to_first_token_seconds_count") >= 1
    assert _value(families, "colibri_library_infer_calls", "colibri_library_infer_calls_total") > 0
    assert _value(families, "colibri_library_bytes_mapped", "colibri_library_bytes_mapped") > 0
    kernels = [s.labels["kernels"] for s in families["colibri_kernels_info"].samples]
    assert kernels and all("decode" in k for k in kernels)
