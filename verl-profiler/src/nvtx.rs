//! NVTX ranges for Nsight Systems without libnvToolsExt (CUDA 13 ships NVTX as headers only).
//!
//! NVTX v3 is a protocol between the program and a tool: on the first range, the program
//! opens the library named by `NVTX_INJECTION64_PATH` (Nsight Systems sets it in the processes
//! it profiles), calls its `InitializeInjectionNvtx2` with a function that hands out export
//! tables, and the tool writes its own functions into the program's slots (one slot per NVTX
//! call, per module). A call whose slot the tool left empty does nothing, so outside Nsight
//! every range is a no-op. This module is that program side, written from the protocol's
//! description: the two export tables (callbacks, version info), six modules' slot tables,
//! and `push` / `pop` / `mark` through the CORE module's `RangePushA` / `RangePop` / `MarkA`.
//!
//! ```
//! // Not under Nsight: nothing is loaded; a range costs a check of a once-set flag and a
//! // slot load.
//! verl_profiler::nvtx::push("update_actor");
//! verl_profiler::nvtx::pop();
//! assert!(!verl_profiler::nvtx::attached());
//! ```

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Modules of the protocol and their slot counts (CORE, CUDA, OPENCL, CUDART, CORE2, SYNC;
/// module 0 is invalid).
const MODULE_SIZES: [usize; 7] = [0, 16, 9, 15, 7, 16, 7];
const MODULE_CORE: usize = 1;
const MAX_SLOTS: usize = 17;
/// CORE slot indices.
const CORE_MARK_A: usize = 2;
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;

const ETID_CALLBACKS: u32 = 1;
const ETID_VERSIONINFO: u32 = 3;
const NVTX_VERSION: u32 = 3;

/// The slots a tool writes its functions into (0 = no function), per module.
static SLOTS: [[AtomicUsize; MAX_SLOTS]; 7] =
    [const { [const { AtomicUsize::new(0) }; MAX_SLOTS] }; 7];

/// Each module's table as the tool reads it: entry 0 empty, entries 1.. the addresses of the
/// slots, a final empty entry as a guard.
static TABLES: OnceLock<[Box<[usize]>; 7]> = OnceLock::new();

fn tables() -> &'static [Box<[usize]>; 7] {
    TABLES.get_or_init(|| {
        std::array::from_fn(|module| {
            let size = MODULE_SIZES[module];
            let mut table = vec![0usize; size + 1];
            for (slot, entry) in table.iter_mut().enumerate().take(size).skip(1) {
                *entry = &SLOTS[module][slot] as *const AtomicUsize as usize;
            }
            table.into_boxed_slice()
        })
    })
}

#[repr(C)]
struct CallbacksTable {
    struct_size: usize,
    get_module_function_table: unsafe extern "C" fn(
        module: u32,
        out_table: *mut *const usize,
        out_size: *mut u32,
    ) -> c_int,
}

#[repr(C)]
struct VersionInfoTable {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(version: u32),
}

static CALLBACKS: CallbacksTable = CallbacksTable {
    struct_size: std::mem::size_of::<CallbacksTable>(),
    get_module_function_table,
};

static VERSION_INFO: VersionInfoTable = VersionInfoTable {
    struct_size: std::mem::size_of::<VersionInfoTable>(),
    version: NVTX_VERSION,
    reserved0: 0,
    set_injection_nvtx_version,
};

unsafe extern "C" fn get_module_function_table(
    module: u32,
    out_table: *mut *const usize,
    out_size: *mut u32,
) -> c_int {
    let module = module as usize;
    if module == 0 || module >= MODULE_SIZES.len() {
        return 0;
    }
    // SAFETY: the tool passes writable pointers or null (checked).
    unsafe {
        if !out_table.is_null() {
            *out_table = tables()[module].as_ptr();
        }
        if !out_size.is_null() {
            *out_size = MODULE_SIZES[module] as u32;
        }
    }
    1
}

unsafe extern "C" fn set_injection_nvtx_version(_version: u32) {}

/// What the tool calls to find the export tables; null for ids this side does not serve.
unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => &CALLBACKS as *const CallbacksTable as *const c_void,
        ETID_VERSIONINFO => &VERSION_INFO as *const VersionInfoTable as *const c_void,
        _ => std::ptr::null(),
    }
}

/// A tool's entry point: `int InitializeInjectionNvtx2(getExportTable)`.
pub type InjectionEntry = unsafe extern "C" fn(unsafe extern "C" fn(u32) -> *const c_void) -> c_int;

/// Whether a tool attached (decided once per process, at the first range).
static ATTACHED: OnceLock<bool> = OnceLock::new();

fn attach() -> bool {
    *ATTACHED.get_or_init(|| {
        let Some(path) = std::env::var_os("NVTX_INJECTION64_PATH") else {
            return false;
        };
        // SAFETY: loading the library Nsight named runs its initialisers, as the NVTX
        // headers do; the library stays loaded for the process's life.
        let library = match unsafe { libloading::Library::new(&path) } {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("NVTX: could not load {}: {e}", path.to_string_lossy());
                return false;
            }
        };
        // SAFETY: the symbol has the protocol's signature.
        let entry = match unsafe { library.get::<InjectionEntry>(b"InitializeInjectionNvtx2\0") } {
            Ok(f) => *f,
            Err(e) => {
                tracing::warn!(
                    "NVTX: {} has no InitializeInjectionNvtx2: {e}",
                    path.to_string_lossy()
                );
                return false;
            }
        };
        std::mem::forget(library);
        // SAFETY: as above.
        unsafe { initialize(entry) }
    })
}

/// Hands this process's tables to a tool's entry point; on failure every slot is emptied (the
/// protocol: a tool that failed gets no calls). Public for tools linked into the program (and
/// tests); Nsight is found through `NVTX_INJECTION64_PATH` at the first range.
///
/// # Safety
/// `entry` must follow the NVTX v3 injection protocol.
pub unsafe fn initialize(entry: InjectionEntry) -> bool {
    tables();
    // SAFETY: per this function's contract.
    let ok = unsafe { entry(get_export_table) } != 0;
    if !ok {
        for module in &SLOTS {
            for slot in module {
                slot.store(0, Ordering::Release);
            }
        }
    }
    ok
}

/// Whether a tool receives the ranges.
pub fn attached() -> bool {
    slot(CORE_RANGE_PUSH_A).is_some()
}

fn slot(index: usize) -> Option<usize> {
    // The first call looks for Nsight's library; a tool handed the tables directly through
    // [`initialize`] has written its slots already.
    attach();
    match SLOTS[MODULE_CORE][index].load(Ordering::Acquire) {
        0 => None,
        f => Some(f),
    }
}

fn message(name: &str) -> CString {
    CString::new(name.replace('\0', " ")).unwrap_or_default()
}

/// Opens a range named `name` on this thread.
pub fn push(name: &str) {
    if let Some(f) = slot(CORE_RANGE_PUSH_A) {
        let name = message(name);
        // SAFETY: the tool wrote a `int (*)(const char*)` into this slot.
        let f: unsafe extern "C" fn(*const c_char) -> c_int = unsafe { std::mem::transmute(f) };
        unsafe { f(name.as_ptr()) };
    }
}

/// Closes this thread's innermost range.
pub fn pop() {
    if let Some(f) = slot(CORE_RANGE_POP) {
        // SAFETY: the tool wrote a `int (*)(void)` into this slot.
        let f: unsafe extern "C" fn() -> c_int = unsafe { std::mem::transmute(f) };
        unsafe { f() };
    }
}

/// An instant marker named `name`.
pub fn mark(name: &str) {
    if let Some(f) = slot(CORE_MARK_A) {
        let name = message(name);
        // SAFETY: the tool wrote a `void (*)(const char*)` into this slot.
        let f: unsafe extern "C" fn(*const c_char) = unsafe { std::mem::transmute(f) };
        unsafe { f(name.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// What the fake tool below received.
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

    unsafe extern "C" fn tool_push(name: *const c_char) -> c_int {
        // SAFETY: NVTX passes the NUL-terminated name the caller of `push` gave it.
        let name = unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        SEEN.lock().unwrap().push(format!("push {name}"));
        0
    }

    unsafe extern "C" fn tool_pop() -> c_int {
        SEEN.lock().unwrap().push("pop".into());
        0
    }

    /// A tool as Nsight's attaches: asks for both tables, checks their sizes and version,
    /// and writes two CORE slots.
    unsafe extern "C" fn fake_tool(get: unsafe extern "C" fn(u32) -> *const c_void) -> c_int {
        // SAFETY: `get` is the injection protocol's table getter, which returns the tables the
        // asserts check (sizes and versions) before any slot is read or written.
        unsafe {
            assert!(get(0).is_null() && get(2).is_null());
            let version = &*(get(ETID_VERSIONINFO) as *const VersionInfoTable);
            assert_eq!((version.struct_size, version.version), (24, 3));
            (version.set_injection_nvtx_version)(3);
            let callbacks = &*(get(ETID_CALLBACKS) as *const CallbacksTable);
            assert_eq!(callbacks.struct_size, 16);
            let mut table: *const usize = std::ptr::null();
            let mut size = 0u32;
            assert_eq!(
                (callbacks.get_module_function_table)(7, &mut table, &mut size),
                0
            );
            assert_eq!(
                (callbacks.get_module_function_table)(1, &mut table, &mut size),
                1
            );
            assert_eq!(size, 16);
            let table = std::slice::from_raw_parts(table, size as usize + 1);
            assert_eq!((table[0], table[16]), (0, 0));
            *(table[CORE_RANGE_PUSH_A] as *mut usize) = tool_push as *const () as usize;
            *(table[CORE_RANGE_POP] as *mut usize) = tool_pop as *const () as usize;
        }
        1
    }

    #[test]
    fn a_tool_attached_through_the_protocol_receives_ranges() {
        // SAFETY: `fake_tool` follows the injection protocol `initialize` expects.
        assert!(unsafe { initialize(fake_tool) });
        push("update_actor");
        mark("not taken: the tool left MarkA empty");
        pop();
        assert_eq!(*SEEN.lock().unwrap(), ["push update_actor", "pop"]);
        assert!(attached());
    }
}
