"""`created` of every answer is its request's arrival time (unix seconds), never the server's start time;
every chunk of one stream carries the same value (in-process server over the stand-in engine; the chat
endpoint, which shares the code, through a real server in tests/test_request_fields.py)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tests.server_fakes import FakeEngine, running_server, sse_events


def test_created_is_the_arrival_time_in_responses_and_chunks() -> None:
    async def main() -> None:
        async with running_server(FakeEngine(delay=0.3)) as (server, url), aiohttp.ClientSession() as s:
            await asyncio.sleep(1.2)  # the server started more than a second before the requests
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            sent = time.time()
            assert int(sent) > server.created
            async with s.post(url + "/v1/completions", json=body) as r:
                whole = await r.json()
            assert int(sent) <= whole["created"] <= int(time.time())
            sent = time.time()
            async with s.post(url + "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
                events = [json.loads(e) for e in sse_events(await r.read())[:-1]]
            assert time.time() - sent > 0.9  # the stream outlived a second: 4 tokens 0.3 s apart
            assert len(events) == 5 and {e["created"] for e in events} == {events[0]["created"]}
            assert int(sent) <= events[0]["created"] <= int(sent) + 1

    asyncio.run(asyncio.wait_for(main(), 30))
