"""The comparison: match ops and tensors, read values by chunk, compute the metrics, judge them.

`pipeline` drives the stages (`matching` -> values through `dumpfile.read` -> `metrics` ->
`verdict`); `streaming` writes rows to disk as they come; `ranks` compares folders of rank
files on Dask; `op_policies`, `bitwise` and `calibrate` adjust the verdict per op class, for
content hashes and for a measured noise floor. Torch-free: `accucmp compare` never imports torch.
"""
