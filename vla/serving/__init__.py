"""Serving a checkpoint to robots: ``vla serve`` (openpi-compatible WebSocket + REST) and the robot-side client.

Modules, one job each:

- ``protocol``    msgpack wire format with openpi's numpy encoding, strict decoding, frame limit (numpy + msgpack only)
- ``json_numpy``  numpy arrays in JSON (the json-numpy convention of OpenVLA's REST deploy script)
- ``requests``    request keys (canonical, openpi LIBERO/DROID/ALOHA, OpenVLA) -> ``Observation``; request limits
- ``batching``    ``MicroBatcher``: requests of concurrent clients batched on a model thread, off the event loop
- ``modes``       serving-mode selection at warm-up (fp32/bf16 x eager/compiled x attention kernel, timed here)
- ``security``    API key file and constant-time ``Authorization: Api-Key`` check
- ``metrics``     Prometheus metrics of one server
- ``server``      the Starlette/uvicorn app: WebSocket, ``POST /act``, ``/healthz``, ``/metadata``, ``/metrics``
- ``serve``       ``vla serve``: load, warm up, print the ready line, run until SIGINT/SIGTERM
- ``client``      torch-free sync and asyncio clients (``WebsocketClient``, ``AsyncWebsocketClient``)
- ``broker``      ``ActionChunkBroker``: execute k of H actions per query, optional prefetch with a blended overlap

Importing this package imports nothing; ``vla.serving.client`` never imports torch.
"""
