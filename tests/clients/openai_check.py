#!/usr/bin/env python3
"""Drives a running `moeforge serve` with the official `openai` client, as a
user's code would. Called by tests/serve.rs; prints one JSON object.

  streams URL PROMPTS MAX   every prompt (token ids, one per line) as its own
                            concurrent stream; per request: token ids, the
                            texts of its chunks, its finish reason
  chat URL                  a chat completion and a streamed one
  queue URL                 with --max-queue 2: two streams held open, the
                            third request refused with 429; then the two
                            clients leave without reading to the end
  drain URL MAX             one stream; prints "started" after its first
                            chunk (the test then stops the server), then
                            reads the stream to its end
  errors URL                bad requests as the client library reports them
"""
import asyncio
import json
import sys

import openai


def client(url, **kw):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)


def ids_of(choice):
    extra = choice.model_extra or {}
    return extra.get("token_ids") or []


async def stream(c, model, prompt, max_tokens):
    s = await c.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    ids, texts, finish = [], [], None
    async for chunk in s:
        ch = chunk.choices[0]
        ids.extend(ids_of(ch))
        texts.append(ch.text)
        if ch.finish_reason is not None:
            finish = ch.finish_reason
    return {"ids": ids, "text": "".join(texts), "finish": finish}


async def streams(url, prompts_file, max_tokens):
    prompts = []
    with open(prompts_file) as f:
        for line in f:
            line = line.strip()
            if line:
                prompts.append([int(t) for t in line.split()])
    async with client(url) as c:
        models = await c.models.list()
        model = models.data[0].id
        results = await asyncio.gather(*(stream(c, model, p, max_tokens) for p in prompts))
    return {"model": model, "results": results}


async def chat(url):
    async with client(url) as c:
        model = (await c.models.list()).data[0].id
        messages = [{"role": "user", "content": "What is a mixture of experts?"}]
        r = await c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        s = await c.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        parts, roles, finish = [], [], None
        async for chunk in s:
            d = chunk.choices[0].delta
            if d.role:
                roles.append(d.role)
            if d.content:
                parts.append(d.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return {
            "content": r.choices[0].message.content,
            "role": r.choices[0].message.role,
            "finish": r.choices[0].finish_reason,
            "usage": [r.usage.prompt_tokens, r.usage.completion_tokens],
            "streamed": "".join(parts),
            "stream_roles": roles,
            "stream_finish": finish,
        }


async def queue(url):
    async with client(url) as c:
        model = (await c.models.list()).data[0].id
        held = []
        for p in ([1, 2, 3], [4, 5, 6]):
            s = await c.completions.create(model=model, prompt=p, max_tokens=400, temperature=0, stream=True)
            it = s.__aiter__()
            await it.__anext__()  # accepted and running
            held.append(s)
        refused = None
        try:
            await c.completions.create(model=model, prompt=[7, 8], max_tokens=4, temperature=0)
        except openai.RateLimitError as e:
            refused = {"status": e.status_code, "type": e.body.get("type") if isinstance(e.body, dict) else None}
        for s in held:
            await s.close()  # leave mid-stream
        return {"refused": refused}


async def drain(url, max_tokens):
    async with client(url) as c:
        model = (await c.models.list()).data[0].id
        s = await c.completions.create(model=model, prompt=[9, 8, 7], max_tokens=max_tokens, temperature=0, stream=True)
        ids, finish, first = [], None, True
        async for chunk in s:
            ids.extend(ids_of(chunk.choices[0]))
            if first:
                print("started", flush=True)
                first = False
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return {"ids": ids, "finish": finish}


async def errors(url):
    out = {}
    async with client(url) as c:
        model = (await c.models.list()).data[0].id
        cases = {
            "max_tokens_zero": dict(model=model, prompt=[1, 2], max_tokens=0),
            "too_long": dict(model=model, prompt=[1, 2], max_tokens=10_000_000),
            "bad_token": dict(model=model, prompt=[1, 999_999], max_tokens=2),
            "bad_temperature": dict(model=model, prompt=[1, 2], max_tokens=2, temperature=7),
            "unknown_model": dict(model="no-such-model", prompt=[1, 2], max_tokens=2),
        }
        for name, kw in cases.items():
            try:
                await c.completions.create(**kw)
                out[name] = None
            except openai.APIStatusError as e:
                body = e.body if isinstance(e.body, dict) else {}
                out[name] = {"status": e.status_code, "type": body.get("type"), "param": body.get("param")}
    return out


def main():
    cmd, url, *rest = sys.argv[1:]
    if cmd == "streams":
        r = asyncio.run(streams(url, rest[0], int(rest[1])))
    elif cmd == "chat":
        r = asyncio.run(chat(url))
    elif cmd == "queue":
        r = asyncio.run(queue(url))
    elif cmd == "drain":
        r = asyncio.run(drain(url, int(rest[0])))
    elif cmd == "errors":
        r = asyncio.run(errors(url))
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
