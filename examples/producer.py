# producer.py: share a tensor with the next process that connects (run consumer.py next)
import torch

import torch_ipc

x = torch.zeros(4, device="cuda" if torch.cuda.is_available() else "cpu")
with torch_ipc.listen("/tmp/torch_ipc_demo.sock", authkey=b"secret") as listener:
    print("producer: waiting; run consumer.py in another terminal")
    with listener.accept() as conn:
        conn.send(x)                    # the consumer gets x's memory, not a copy
        assert conn.recv() == "done"    # it wrote into it and let go
print("producer sees:", x.tolist())     # [1.0, 1.0, 1.0, 1.0]
