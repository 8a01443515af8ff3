"""Expert parallelism over several machines: one coordinator (spine, attention, routers, sampling,
the API) and N expert nodes that hold the routed experts on their own drives and compute them.

coordinator.py is the coordinator's `ExpertProvider`; node.py the node process (`deltafind node`);
wire.py the process group and messages (torch.distributed); placement.py who holds which expert.
"""
