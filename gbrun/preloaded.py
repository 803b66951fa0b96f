"""The fork server's last import (gbrun.fork_server.preload): every module
a CPU rank needs is imported by then, so it moves them out of the cyclic
garbage collector's reach (gc.freeze, as Python's docs advise before
forking): the ranks forked from the server skip them in each collection
and keep sharing their memory pages instead of copying them, and the
server's exit does not walk them (about 1 CPU-s). Imported nowhere else."""
import gc

gc.freeze()
