"""Runtime: loading (loader, assets) and the inference layout built once from the weights
(backend, linear, layer, target). Import submodules directly, e.g. `eagle3.runtime.target`."""
