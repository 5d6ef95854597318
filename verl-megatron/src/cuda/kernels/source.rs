//! Hand-written CUDA C++ kernels launched on burn's own stream: a [`CudaSource`] is a cubecl
//! `CubeTask` whose "compilation" hands cubecl-cuda our source text, which it compiles with
//! NVRTC (for `sm_90a` on Hopper) once per kernel id and launches in order with burn's
//! operations, with no host synchronisation.
//!
//! cubecl-cuda reads one thing from the compiled kernel's representation: its dynamic
//! shared-memory size (it sets the function attribute from it). So the representation is an
//! empty cubecl-cpp kernel whose only content is one byte array of that size. Kernel
//! parameters arrive in order: one device pointer per buffer, then the `info` words (`u64`s)
//! by value as a single struct, which the CUDA side declares with the same layout.
//!
//! A launch may also carry tensor maps for Hopper's bulk tensor copies (TMA): cubecl-cuda
//! encodes each one at launch from its operand's binding (`cuTensorMapEncodeTiled`) and passes
//! it by value ahead of everything else, followed by the maps' operands as pointers, then the
//! buffers and the info struct. The CUDA side declares the maps as `const __grid_constant__`
//! 128-byte structs, whose addresses the copy instructions take. cubecl waits on other
//! streams' writes only for a launch's buffers, so an operand read through a map is passed
//! again as a buffer.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use cubecl::cuda::{CudaCompiler, CudaComputeKernel, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::{KernelArguments, MetadataBindingInfo, TensorMapBinding, TensorMapMeta};
use cubecl::zspace::{metadata::Metadata, Shape, Strides};
use cubecl::{CompilationError, CubeTask};
use cubecl_cpp::shared::{Body, Elem, Flags, Item, SharedMemory};

use super::CudaPrimitive;

/// One entry point of a CUDA C++ source, specialised by `#define`s.
#[derive(Debug, Clone)]
pub struct CudaSource {
    /// The `extern "C" __global__` function's name.
    pub entry: &'static str,
    /// The source text (with `include_str!`, the `.cu` file next to the module).
    pub text: &'static str,
    /// `(name, value)` pairs prepended as `#define name value`; part of the kernel id.
    pub defines: Vec<(&'static str, u32)>,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: usize,
}

impl CudaSource {
    /// Entry `entry` of `text` as it is: no defines, no dynamic shared memory, `block` threads.
    pub fn plain(entry: &'static str, text: &'static str, block: u32) -> Self {
        Self {
            entry,
            text,
            defines: Vec::new(),
            block,
            shared_bytes: 0,
        }
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim {
            x: self.block,
            y: 1,
            z: 1,
        }
    }

    /// The full source NVRTC compiles.
    pub fn source(&self) -> String {
        let mut s = String::new();
        for (name, value) in &self.defines {
            s.push_str(&format!("#define {name} {value}\n"));
        }
        s.push_str(self.text);
        s
    }

    /// The stand-in representation: an empty kernel with `shared_bytes` of shared memory.
    fn representation(&self) -> CudaComputeKernel {
        let body = Body {
            instructions: Vec::new(),
            shared_memories: vec![SharedMemory::Array {
                index: 0,
                item: Item::scalar(Elem::U8, true),
                length: self.shared_bytes,
                align: 128,
                offset: 0,
            }],
            pipelines: Vec::new(),
            barriers: Vec::new(),
            const_arrays: Vec::new(),
            local_arrays: Vec::new(),
            info_by_ptr: false,
            has_dynamic_meta: false,
            address_type: Item::scalar(Elem::U32, true),
        };
        let flags = Flags {
            use_grid_constants: true,
            has_info: true,
            ..Default::default()
        };
        CudaComputeKernel {
            tensor_maps: Vec::new(),
            buffers: Vec::new(),
            scalars: Vec::new(),
            info: Default::default(),
            meta_static_len: 0,
            body,
            cube_dim: self.cube_dim(),
            cluster_dim: None,
            extensions: Vec::new(),
            flags,
            items: Default::default(),
            kernel_name: self.entry.to_string(),
        }
    }

    /// Launches on `client` (burn's stream for the calling thread) over `grid` blocks with
    /// `buffers` as the pointer parameters, in order, and `info` as the trailing struct.
    pub fn launch(
        self,
        client: &ComputeClient<CudaRuntime>,
        grid: (u32, u32, u32),
        buffers: &[&CudaPrimitive],
        info: Vec<u64>,
    ) {
        self.launch_with_maps(client, grid, &[], buffers, info)
    }

    /// As [`CudaSource::launch`], with tensor maps first: cubecl encodes each one at launch
    /// from its operand's binding and passes it by value ahead of every other parameter, then
    /// the maps' operands as pointers, then `buffers`, then `info`.
    pub fn launch_with_maps(
        self,
        client: &ComputeClient<CudaRuntime>,
        grid: (u32, u32, u32),
        maps: &[TileMap<'_>],
        buffers: &[&CudaPrimitive],
        info: Vec<u64>,
    ) {
        let mut args = KernelArguments::new();
        args.tensor_maps = maps.iter().map(TileMap::binding).collect();
        for b in buffers {
            args = args.with_buffer(b.handle.clone().binding());
        }
        let len = info.len();
        let args = args.with_info(MetadataBindingInfo::new(info, len));
        client.launch(
            Box::new(self),
            CubeCount::Static(grid.0, grid.1, grid.2),
            args,
        );
    }
}

/// A bf16 matrix operand read by Hopper's bulk tensor copies: `rows × cols` elements, rows
/// `pitch` elements apart, in boxes of `box_rows` rows × 64 columns (128 bytes, the 128-byte
/// swizzle's span), zero-filled past the edges.
#[derive(Debug, Clone, Copy)]
pub struct TileMap<'a> {
    pub operand: &'a CudaPrimitive,
    pub rows: usize,
    pub cols: usize,
    pub pitch: usize,
    pub box_rows: usize,
}

impl TileMap<'_> {
    /// Columns of a box: 128 bytes of bf16.
    pub const BOX_COLS: usize = 64;

    fn binding(&self) -> TensorMapBinding {
        use cubecl::prelude::{
            OobFill, TensorMapFormat, TensorMapInterleave, TensorMapPrefetch, TensorMapSwizzle,
            TiledArgs,
        };
        TensorMapBinding {
            binding: self.operand.handle.clone().binding(),
            map: TensorMapMeta {
                format: TensorMapFormat::Tiled(TiledArgs {
                    tile_size: Shape::new([self.box_rows, Self::BOX_COLS]),
                }),
                metadata: Metadata::new(
                    Shape::new([self.rows, self.cols]),
                    Strides::new(&[self.pitch, 1]),
                ),
                elem_stride: Strides::new(&[1, 1]),
                interleave: TensorMapInterleave::None,
                swizzle: TensorMapSwizzle::B128,
                prefetch: TensorMapPrefetch::B256,
                oob_fill: OobFill::Zero,
                storage_ty: half::bf16::as_type_native_unchecked().storage_type(),
            },
        }
    }
}

impl KernelMetadata for CudaSource {
    fn name(&self) -> &'static str {
        self.entry
    }

    fn id(&self) -> KernelId {
        KernelId::new::<Self>()
            .info((
                self.entry,
                self.defines.clone(),
                self.shared_bytes,
                text_hash(self.text),
            ))
            .cube_dim(self.cube_dim())
    }

    fn address_type(&self) -> StorageType {
        u32::as_type_native_unchecked().storage_type()
    }
}

impl CubeTask<CudaCompiler> for CudaSource {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _options: &<CudaCompiler as cubecl::Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        Ok(CompiledKernel {
            entrypoint_name: self.entry.to_string(),
            debug_name: Some(self.entry),
            source: self.source(),
            repr: Some(self.representation()),
            cube_dim: self.cube_dim(),
            debug_info: None,
        })
    }
}

/// A hash of a kernel's source text, part of its id: cubecl's on-disk cache (when a user turns
/// it on) must not hand back the compiled code of an older version of the same file. Computed
/// once per text (keyed by its address: the texts are `include_str!` statics).
fn text_hash(text: &'static str) -> u64 {
    static HASHES: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
    let key = text.as_ptr() as usize;
    let mut hashes = HASHES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(_, h)) = hashes.iter().find(|(k, _)| *k == key) {
        return h;
    }
    let mut hasher = DefaultHasher::new();
    text.hash(&mut hasher);
    let h = hasher.finish();
    hashes.push((key, h));
    h
}

/// 32-bit words packed two to a `u64`, low word first (the CUDA struct's field order on a
/// little-endian GPU).
pub fn pack_words(words: &[u32]) -> Vec<u64> {
    words
        .chunks(2)
        .map(|w| w[0] as u64 | (w.get(1).copied().unwrap_or(0) as u64) << 32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_pack_low_first() {
        assert_eq!(pack_words(&[1, 2, 3]), vec![1 | 2 << 32, 3]);
        assert_eq!(pack_words(&[]), Vec::<u64>::new());
    }

    #[test]
    fn defines_come_first_and_name_the_kernel() {
        let k = CudaSource {
            entry: "f",
            text: "extern \"C\" __global__ void f() {}",
            defines: vec![("HEAD_DIM", 64)],
            block: 128,
            shared_bytes: 1024,
        };
        assert!(k.source().starts_with("#define HEAD_DIM 64\n"));
        assert_eq!(k.representation().shared_memory_size(), 1024);
        let mut other = k.clone();
        other.defines = vec![("HEAD_DIM", 128)];
        assert_ne!(k.id(), other.id());
        // Another source text with the same entry and defines is another kernel.
        let mut edited = k.clone();
        edited.text = "extern \"C\" __global__ void f() { }";
        assert_ne!(k.id(), edited.id());
        // The cache hands each text its own hash (keyed by address), the one a fresh hasher
        // computes, on the first call and on the cached ones.
        let fresh = |t: &str| {
            let mut h = DefaultHasher::new();
            t.hash(&mut h);
            h.finish()
        };
        for _ in 0..2 {
            assert_eq!(text_hash(k.text), fresh(k.text));
            assert_eq!(text_hash(edited.text), fresh(edited.text));
        }
        assert_ne!(text_hash(k.text), text_hash(edited.text));
    }
}
