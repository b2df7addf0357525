# Sourced by every device run script (run from the repository root): the wheels the lent GPU machine
# lacks (pydantic, pyzmq, carried in .whl/: see the device tool's README), and the NCCL settings those
# machines need (no NVLink multicast).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
