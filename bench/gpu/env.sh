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
# Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, MLP 4864, vocabulary 151 936, tied
# embeddings) for the built-in task's model, as the GPU scripts' jobs use it.
QWEN05B=(actor_rollout_ref.model.override_config.hidden_size=896
         actor_rollout_ref.model.override_config.intermediate_size=4864
         actor_rollout_ref.model.override_config.num_hidden_layers=24
         actor_rollout_ref.model.override_config.num_attention_heads=14
         actor_rollout_ref.model.override_config.num_key_value_heads=2
         actor_rollout_ref.model.override_config.vocab_size=151936
         actor_rollout_ref.model.override_config.tie_word_embeddings=true)
