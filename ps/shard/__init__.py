"""A parameter-server shard, in the parts it is made of.

- server.py: ShardServer, the shard's state and one handler per op;
- dispatch.py: validation of every message, then its op's handler; the serve loop;
- consistency.py: the rules sync, async and ssp: when a push updates, when a pull is answered;
- workers.py: who joined, left or is lost, and each worker's clock;
- waiting.py: requests answered once their condition holds, or an error at their deadline;
- snapshots.py: the values replies carry, and the buffers reused for them;
- rows.py: row-sparse gradients and row-collision counts;
- optim.py: the experiment's optimizer, stepped over any subset of the chunks;
- settings.py: the settings every process of a run must share, checked at join;
- init.py: a shard started without a model waits for worker 0's init.
"""

from ps.shard.consistency import MODES
from ps.shard.init import await_init
from ps.shard.server import ShardServer

__all__ = ["MODES", "ShardServer", "await_init"]
