"""psar's metadata is in setup.cfg; this adds its three compiled modules, the shard's push+pull
path (ps/shard/_compiled.c; ps/shard/compiled.py), the worker's lane (ps/_client.c;
ps/client_compiled.py) and the shard's sends (ps/_send.c; ps/transport.py). They are
optional: where they do not build (no C compiler, no Python headers), psar installs without
them and its shards and workers take the Python paths."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ps.shard._compiled", ["ps/shard/_compiled.c"], optional=True,
                             depends=["ps/shard/_msgpack.h", "ps/shard/_sgd.h", "ps/shard/_split.h", "ps/shard/_sync.h"],
                             extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11"], libraries=["m", "pthread"]),
                   Extension("ps._client", ["ps/_client.c"], optional=True,
                             depends=["ps/shard/_msgpack.h", "ps/_zmq.h"], extra_compile_args=["-O2", "-std=c11"]),
                   Extension("ps._send", ["ps/_send.c"], optional=True, depends=["ps/_zmq.h"],
                             extra_compile_args=["-O2", "-std=c11"])])
