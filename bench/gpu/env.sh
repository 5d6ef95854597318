# Sourced by the GPU scripts: NVLink multicast off, and a `libnccl.so` that cudarc can load
# (it looks for that name; the machines ship only NCCL's soname libnccl.so.2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! ldconfig -p | grep -q 'libnccl.so '; then
  nccl=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')
  [ -z "$nccl" ] && nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  mkdir -p /tmp/verl-nccl && ln -sf "$nccl" /tmp/verl-nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/verl-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "libnccl.so -> $nccl"
fi
VERL=${VERL:-./gpu-bin/verl}
