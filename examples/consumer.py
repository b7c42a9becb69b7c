# consumer.py: run while producer.py waits
import torch

import torch_ipc

with torch_ipc.connect("/tmp/torch_ipc_demo.sock", authkey=b"secret") as conn:
    y = conn.recv()                     # the producer's tensor, same memory
    y.add_(1)                           # the producer sees this write
    if y.is_cuda:
        torch.cuda.synchronize()        # finished before we say so
    del y                               # let go of the producer's memory...
    torch_ipc.collect()                 # ...now, not within the collector's 50 ms
    conn.send("done")
print("consumer: done")
