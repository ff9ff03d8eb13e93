"""An OpenAI-compatible server of a model Colibri runs:

  python -m colibri.serve MODEL [--host 127.0.0.1] [--port 8000] [--threads N]
                                [--max-batch 8] [--ctx-size N] [--max-resident BYTES]
                                [--tokenizer PATH] [--chat-template FILE] [--name NAME]

MODEL is what colibri.torch.from_pretrained opens (a GGUF file or a
checkpoint directory). Endpoints: POST /v1/chat/completions and
/v1/completions (streaming with `"stream": true`, as server-sent events),
GET /v1/models, /health and /metrics (Prometheus text, colibri.metrics).

Requests are generated together by colibri.batching's engine: they join
and leave the batch between decode steps (continuous batching), so several
clients share each weight read while each greedy stream stays what it
would be alone. A request the model cannot run (malformed JSON, a field of
the wrong type, an option the server does not implement, a prompt plus
max_tokens past the context) gets OpenAI's error object with a 4xx status
and is never truncated; a client that disconnects frees its slot at the
next step.

Built on FastAPI and uvicorn: transformers' own `transformers serve` loads
models by name through its from_pretrained and cannot take a model built
by Colibri's loader.

The tokenizer: a GGUF's own (transformers' AutoTokenizer with gguf_file=,
for the byte-level BPE files it reads), a checkpoint directory's, or
--tokenizer. The chat template: the tokenizer's, else --chat-template,
else ChatML (what Qwen's templates produce for plain messages), with a
warning.
"""

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from typing import List, Optional, Union

log = logging.getLogger("colibri.serve")

_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class RequestError(Exception):
    """A request the server refuses: OpenAI's error object with `status`."""

    def __init__(self, message, param=None, status=400, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def load_tokenizer(model_path, tokenizer=None, chat_template=None):
    """The tokenizer for `model_path` (module docstring), with a chat
    template set. Raises RequestError-free ValueError naming the path when
    none can be read."""
    from transformers import AutoTokenizer
    source = tokenizer or model_path
    try:
        if os.path.isfile(source) and source.endswith(".gguf"):
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(source)),
                                                gguf_file=os.path.basename(source))
        else:
            tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise ValueError("%s: no tokenizer transformers can read (%s: %s); pass --tokenizer with the model's "
                         "original repository directory" % (source, type(e).__name__, e)) from e
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            tok.chat_template = f.read()
    elif not getattr(tok, "chat_template", None):
        log.warning("%s has no chat template; /v1/chat/completions uses ChatML (pass --chat-template)", source)
        tok.chat_template = _CHATML
    return tok


class _Stream:
    """One request's tokens as they come from the engine's thread, and
    their text as the client sees it: decoded from all tokens so far (a
    token may end inside a UTF-8 character), cut at the first stop string,
    with the tail that could begin one held back until it is decided."""

    def __init__(self, loop, tokenizer, stops):
        self.loop, self.tokenizer, self.stops = loop, tokenizer, [s for s in stops if s]
        self.queue = asyncio.Queue()
        self.tokens, self.sent, self.stopped = [], 0, False

    def on_token(self, seq, token):  # the engine's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, time.perf_counter()))

    def text_delta(self, final):
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped, final = text[:at], True, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for stop in self.stops:  # the longest tail that is a prefix of a stop string
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if text[end - n:end] == stop[:n]:
                        end -= n
                        break
        delta = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta


def build_app(model, tokenizer, engine, name, metrics=None):
    """The FastAPI application serving `model` through `engine` (a started
    colibri.batching.Engine)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    class _Common(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: Optional[str] = None
        max_tokens: Optional[int] = Field(default=None, ge=1)
        max_completion_tokens: Optional[int] = Field(default=None, ge=1)
        temperature: float = Field(default=1.0, ge=0, le=2)
        top_p: float = Field(default=1.0, gt=0, le=1)
        n: int = 1
        seed: Optional[int] = None
        stop: Union[str, List[str], None] = None
        stream: bool = False
        stream_options: Optional[dict] = None
        ignore_eos: bool = False  # llama-server's and vLLM's extension: generate max_tokens whatever comes

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: str
        content: Union[str, List[dict], None] = None

    class ChatRequest(_Common):
        messages: List[Message] = Field(min_length=1)

    class CompletionRequest(_Common):
        prompt: Union[str, List[int], List[str], List[List[int]]]
        echo: bool = False
        logprobs: Optional[int] = None

    app = FastAPI(title="colibri", docs_url=None, redoc_url=None)
    created = int(time.time())

    def count(endpoint, status):
        if metrics is not None:
            metrics.requests.labels(endpoint, str(status)).inc()

    @app.exception_handler(RequestError)
    async def _refused(request, e):
        count(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e):
        first = e.errors()[0] if e.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        err = RequestError("%s%s" % (".".join(where) + ": " if where else "", first.get("msg", "invalid request")),
                           param=".".join(where) or None)
        count(request.url.path, 400)
        return JSONResponse(err.body(), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.busy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "colibri"}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise RequestError("metrics are off", status=404, code="not_found")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_common(req):
        if req.model is not None and req.model != name:
            raise RequestError("the model `%s` does not exist; this server has `%s`" % (req.model, name),
                               param="model", status=404, code="model_not_found")
        if req.n != 1:
            raise RequestError("n must be 1 (one choice per request)", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4:
            raise RequestError("at most 4 stop sequences", param="stop")
        return stops

    def prompt_ids(req):
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            raise RequestError("one prompt per request", param="prompt")
        if isinstance(p, str):
            return tokenizer(p, add_special_tokens=False)["input_ids"]
        return list(p)

    def chat_ids(req):
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: text only
                if any(part.get("type") != "text" for part in content):
                    raise RequestError("only text content parts are supported", param="messages")
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise RequestError("the chat template cannot render these messages: %s" % e, param="messages") from e
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    async def generate(request, req, ids, stops, endpoint, chat):
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, tokenizer, stops)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = 16 if not chat else max(1, engine.context_length - len(ids))
        received = time.perf_counter()
        try:
            seq = engine.submit(ids, max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                on_token=stream.on_token, stop_tokens=[] if req.ignore_eos else None)
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise RequestError(str(e), param="max_tokens" if code else "prompt", code=code) from e
        if metrics is not None:
            metrics.prompt_tokens.inc(len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        kind = "chat.completion" if chat else "text_completion"

        def choice(text, finish):
            if chat:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        def usage():
            n = len(seq.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        async def tokens():
            """(delta text, finish reason or None) as tokens arrive."""
            last = None
            while True:
                token, at = await stream.queue.get()
                if token is None:
                    reason = "stop" if stream.stopped or seq.finish_reason == "stop" else seq.finish_reason
                    if metrics is not None:
                        metrics.duration.observe(at - received)
                    if seq.finish_reason == "error":
                        raise RuntimeError(seq.error)
                    yield stream.text_delta(final=True), reason
                    return
                if metrics is not None:
                    metrics.generated_tokens.inc()
                    if last is None:
                        metrics.ttft.observe(at - received)
                    else:
                        metrics.itl.observe(at - last)
                last = at
                if token not in seq.stop_tokens:
                    stream.tokens.append(token)
                delta = stream.text_delta(final=False)
                if stream.stopped:
                    seq.cancel()  # a stop string ends it: no more tokens wanted
                yield delta, None

        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))

            def chunk(delta, finish, role=False):
                if chat:
                    d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                    c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
                else:
                    c = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
                body = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": int(time.time()),
                        "model": name, "choices": [c]}
                if include_usage:
                    body["usage"] = None
                return "data: %s\n\n" % json.dumps(body)

            async def events():
                try:
                    if chat:
                        yield chunk("", None, role=True)
                    async for delta, finish in tokens():
                        if delta or finish:
                            yield chunk(delta, finish)
                    if include_usage:
                        body = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": int(time.time()),
                                "model": name, "choices": [], "usage": usage()}
                        yield "data: %s\n\n" % json.dumps(body)
                    yield "data: [DONE]\n\n"
                except RuntimeError as e:
                    yield "data: %s\n\n" % json.dumps(RequestError(str(e), status=500, kind="server_error").body())
                finally:
                    seq.cancel()  # a client gone mid-stream frees its slot

            count(endpoint, 200)
            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect():
            text, reason = [], None
            async for delta, finish in tokens():
                text.append(delta)
                reason = finish or reason
            return "".join(text), reason

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    seq.cancel()
                    task.cancel()
                    count(endpoint, 499)
                    return JSONResponse(RequestError("client disconnected", status=499).body(), status_code=499)
            text, reason = task.result()
        except RuntimeError as e:
            count(endpoint, 500)
            return JSONResponse(RequestError(str(e), status=500, kind="server_error").body(), status_code=500)
        finally:
            seq.cancel()
        count(endpoint, 200)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": name,
                "choices": [choice(text, reason)], "usage": usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest):
        stops = check_common(req)
        return await generate(request, req, chat_ids(req), stops, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        stops = check_common(req)
        if req.echo:
            raise RequestError("echo is not supported", param="echo")
        if req.logprobs:
            raise RequestError("logprobs are not supported", param="logprobs")
        return await generate(request, req, prompt_ids(req), stops, "/v1/completions", chat=False)

    return app


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m colibri.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF file or a checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--threads", "-t", type=int, default=0, help="Colibri's threads (0: one per core)")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    ap.add_argument("--ctx-size", "-c", type=int, default=0,
                    help="tokens a request may hold, prompt and output (default: the model's context)")
    ap.add_argument("--max-resident", type=int, default=None, help="expert bytes kept in memory (GGUF files)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory or GGUF (default: the model's)")
    ap.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    ap.add_argument("--name", default=None, help="the model's id in /v1/models (default: the file's name)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from . import batching, metrics as colibri_metrics
    from .torch import from_pretrained

    try:
        tokenizer = load_tokenizer(args.model, args.tokenizer, args.chat_template)
        model = from_pretrained(args.model, threads=args.threads, max_resident=args.max_resident)
    except (OSError, ValueError) as e:
        print("colibri.serve: %s" % e, file=sys.stderr)
        return 2
    name = args.name or os.path.basename(os.path.normpath(args.model))
    engine = batching.Engine(model, max_batch=args.max_batch, context_length=args.ctx_size or None)
    metrics = colibri_metrics.ServerMetrics(model, engine)
    engine.on_step, engine.on_finish = metrics.on_step, metrics.on_finish
    engine.start()
    app = build_app(model, tokenizer, engine, name, metrics)
    log.info("serving %s (%s) on http://%s:%d, batch %d, context %d", name, args.model, args.host, args.port,
             args.max_batch, engine.context_length)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
