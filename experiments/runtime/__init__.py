"""The processes of a run: the launcher, the zygote they fork from (torch imported once),
the worker and server-shard entry points, the sites they run at (loopback or emulated hosts)
and the emulated network (namespaces, links, tc)."""
