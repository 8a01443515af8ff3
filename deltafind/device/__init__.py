"""Where the model computes: device choice, host-to-device staging, device memory budgets.

`select` turns `[device] kind` into a torch.device (and says why); `staging`
moves expert records from the read buffers onto the device (pinned buffers and
a copy stream on CUDA); `device_cache` sizes the expert cache from the device's
live free memory. Knows torch and the store's cache type; never models or engine.
"""
