//! `verl bench offload` (the `cuda` build): how fast a role's state moves between the GPU and
//! host memory, through burn-cuda's own round trip (`OffloadManager`) and through the pinned
//! store (`PinnedOffload`), and how much of a prefetch hides behind compute. Every round trip is
//! checked bit for bit against the tensors that went out (an error on a mismatch).
//! Peer: bench/peers/offload.py (torch pinned tensors and `copy_(non_blocking=True)`).

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{Distribution, TensorData};
use verl::backend::CudaBackend;
use verl::core::traits::HostOffload;
use verl::megatron::cuda::rank_device;
use verl::offload::{OffloadManager, PinnedOffload};

use super::median;

type Cuda = CudaBackend;

/// `total_gib` of f32 split into `parts` tensors, random (so a wrong copy shows).
fn state(
    total_gib: f64,
    parts: usize,
    device: &burn::backend::cuda::CudaDevice,
) -> Vec<Tensor<Cuda, 1>> {
    let elems = (total_gib * (1u64 << 30) as f64 / 4.0) as usize / parts.max(1);
    (0..parts)
        .map(|_| Tensor::random([elems.max(1)], Distribution::Normal(0.0, 1.0), device))
        .collect()
}

fn sync(device: &burn::backend::cuda::CudaDevice) -> Result<(), String> {
    <Cuda as Backend>::sync(device).map_err(|e| format!("{e:?}"))
}

/// Each tensor's bits, to compare a round trip against.
fn bits(tensors: &[Tensor<Cuda, 1>]) -> Vec<TensorData> {
    tensors.iter().map(|t| t.to_data()).collect()
}

fn same(a: &[TensorData], b: &[Tensor<Cuda, 1>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.bytes[..] == y.to_data().bytes[..])
}

/// A stand-in for a backward pass: `n` products of `m`×`m` matrices.
fn compute(x: &Tensor<Cuda, 2>, n: usize) -> Tensor<Cuda, 2> {
    let mut y = x.clone();
    for _ in 0..n {
        y = y.matmul(x.clone()).mul_scalar(1e-3);
    }
    y
}

/// Times `repeat` round trips of `store`: (first offload s, offload s, reload s) medians.
fn round_trips(
    store: &mut dyn HostOffload<Cuda>,
    tensors: Vec<Tensor<Cuda, 1>>,
    want: &[TensorData],
    repeat: usize,
    device: &burn::backend::cuda::CudaDevice,
) -> Result<(f64, f64, f64), String> {
    let mut tensors = tensors;
    let (mut outs, mut backs, mut first) = (Vec::new(), Vec::new(), 0.0);
    for i in 0..=repeat {
        sync(device)?;
        let t = Instant::now();
        store.offload("s", tensors).map_err(|e| e.to_string())?;
        let out = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (back, _) = store.reload("s", device).map_err(|e| e.to_string())?;
        sync(device)?;
        let b = t.elapsed().as_secs_f64();
        if i == 0 {
            first = out;
        } else {
            outs.push(out);
            backs.push(b);
        }
        tensors = back;
    }
    if !same(want, &tensors) {
        return Err("a round trip changed the tensors".into());
    }
    Ok((first, median(outs), median(backs)))
}

pub(crate) fn offload(total_gib: f64, parts: usize, repeat: usize) -> Result<(), String> {
    let device = rank_device(0);
    let tensors = state(total_gib, parts, &device);
    let want = bits(&tensors);
    let bytes = want.iter().map(|d| d.bytes.len()).sum::<usize>() as f64;
    let gbs = |s: f64| bytes / s / 1e9;
    println!(
        "offload bench: {:.2} GiB of f32 in {parts} tensors, {repeat} timed round trips (median)",
        bytes / (1u64 << 30) as f64
    );
    println!("| store | first offload (allocates) s | offload s (GB/s) | reload s (GB/s) |");
    println!("|---|---|---|---|");
    let mut copies = tensors.clone();
    let mut portable = OffloadManager::<Cuda>::new("bench");
    let (first, out, back) = round_trips(&mut portable, copies, &want, repeat, &device)?;
    println!(
        "| burn round trip (OffloadManager) | {first:.3} | {out:.3} ({:.1}) | {back:.3} ({:.1}) |",
        gbs(out),
        gbs(back)
    );
    drop(portable);
    copies = tensors;
    let mut pinned = PinnedOffload::new("bench").with_prefetch_headroom(0);
    let (first, out, back) = round_trips(&mut pinned, copies, &want, repeat, &device)?;
    println!(
        "| pinned (PinnedOffload) | {first:.3} | {out:.3} ({:.1}) | {back:.3} ({:.1}) |",
        gbs(out),
        gbs(back)
    );

    let tensors = overlap(&mut pinned, (total_gib, parts), back, repeat, &device)?;
    read_only_put_away(&mut pinned, tensors, repeat, &device)?;
    println!(
        "pinned host memory held by the store: {:.2} GiB",
        pinned.host_bytes() as f64 / (1u64 << 30) as f64
    );
    Ok(())
}

/// Overlap: a reload started before compute and finished after it, against both in a row
/// (`reload_s`, the reload's time alone, sizes the compute). Gives back the reloaded state.
fn overlap(
    pinned: &mut PinnedOffload,
    (total_gib, parts): (f64, usize),
    back: f64,
    repeat: usize,
    device: &burn::backend::cuda::CudaDevice,
) -> Result<Vec<Tensor<Cuda, 1>>, String> {
    let mut tensors = state(total_gib, parts, device);
    let x = Tensor::<Cuda, 2>::random([4096, 4096], Distribution::Normal(0.0, 1.0), device);
    // Size the compute to about the reload's time (after a warm-up: the first launch compiles).
    let _ = compute(&x, 2).into_data();
    sync(device)?;
    let t = Instant::now();
    let _ = compute(&x, 10).into_data();
    let per = t.elapsed().as_secs_f64() / 10.0;
    let n = ((back / per).ceil() as usize).max(1);
    let (mut serial, mut overlapped, mut alone) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeat.max(1) {
        sync(device)?;
        let t = Instant::now();
        let _ = compute(&x, n).into_data();
        alone.push(t.elapsed().as_secs_f64());

        pinned.offload("s", tensors).map_err(|e| e.to_string())?;
        sync(device)?;
        let t = Instant::now();
        let (back, _) = pinned.reload("s", device).map_err(|e| e.to_string())?;
        let _ = compute(&x, n).into_data();
        serial.push(t.elapsed().as_secs_f64());

        pinned.offload("s", back).map_err(|e| e.to_string())?;
        sync(device)?;
        let t = Instant::now();
        let started = pinned.prefetch("s", device).map_err(|e| e.to_string())?;
        let y = compute(&x, n);
        let (back, _) = pinned.reload("s", device).map_err(|e| e.to_string())?;
        let _ = y.into_data();
        overlapped.push(t.elapsed().as_secs_f64());
        if !started {
            return Err("the prefetch did not start (no room on the device?)".into());
        }
        tensors = back;
    }
    let (alone, serial, overlapped) = (median(alone), median(serial), median(overlapped));
    println!(
        "overlap: {n} products of 4096² ({:.3} s) with a reload of the same state: in a row {serial:.3} s, \
         prefetched {overlapped:.3} s ({:.0}% of the copy hidden)",
        alone,
        100.0 * (serial - overlapped) / (serial - alone).max(1e-9)
    );
    Ok(tensors)
}

/// A read-only phase's put-away: the pinned copy is still the tensors' values, so nothing is
/// copied, and the reload gives the same bits.
fn read_only_put_away(
    pinned: &mut PinnedOffload,
    mut tensors: Vec<Tensor<Cuda, 1>>,
    repeat: usize,
    device: &burn::backend::cuda::CudaDevice,
) -> Result<(), String> {
    let want_now = bits(&tensors);
    let (mut unchanged, mut reloads) = (Vec::new(), Vec::new());
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let report = pinned
            .offload_unchanged("s", tensors)
            .map_err(|e| e.to_string())?;
        unchanged.push(t.elapsed().as_secs_f64());
        if report.bytes != 0 {
            return Err("an unchanged put-away copied".into());
        }
        let t = Instant::now();
        let (back, _) = pinned.reload("s", device).map_err(|e| e.to_string())?;
        sync(device)?;
        reloads.push(t.elapsed().as_secs_f64());
        tensors = back;
    }
    if !same(&want_now, &tensors) {
        return Err("the unchanged put-aways changed the tensors".into());
    }
    println!(
        "read-only put-away (offload_unchanged): {:.4} s, then reload {:.3} s; exact",
        median(unchanged),
        median(reloads)
    );
    Ok(())
}
