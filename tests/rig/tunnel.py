"""A public tunnel's stand-in: a plain TCP forwarder from a port of its own to the capture proxy's.

    python tests/rig/tunnel.py LISTEN_PORT TARGET_PORT PID_FILE

gradio's and cloudflare's tunnels need the internet; this one forwards bytes as they do, so the sandbox reaches the
capture proxy through a URL that is not the proxy's own, and a test can kill it (its pid is in PID_FILE) as a tunnel
dies mid-run. rig/harbor_server.py makes it `openenv harbor serve --expose gradio`'s forwarder when RIG_TUNNEL_DIR is
set.
"""

from __future__ import annotations

import asyncio
import os
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def forward(target_port: int, client_reader, client_writer) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", target_port)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))


async def main(listen_port: int, target_port: int, pid_file: str) -> None:
    server = await asyncio.start_server(lambda r, w: forward(target_port, r, w), "127.0.0.1", listen_port)
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
