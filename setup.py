"""psar's metadata is in setup.cfg; this adds its one compiled module, the shard's push+pull
path (ps/shard/_compiled.c; ps/shard/compiled.py). It is optional: where it does not build
(no C compiler, no Python headers), psar installs without it and its shards take the Python
paths."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ps.shard._compiled", ["ps/shard/_compiled.c"], optional=True,
                             depends=["ps/shard/_msgpack.h", "ps/shard/_sgd.h"],
                             extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11"], libraries=["m"])])
