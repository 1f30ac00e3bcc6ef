// The CUDA ops of lightning_fusedsgd (defined in lightning_fusedsgd/ops/__init__.py), their host code: each checks
// its arguments (bucket.h), uploads its tables (cuda_launch.h) and launches the kernels (cuda_kernels.h) on the
// current stream: one launch per (device, dtype) bucket over a work list of fixed-size chunks across all tensors,
// of the update (with LARS, lars_sq_sums's two launches first, whose rows the update reads; a sharded step passes
// them reduced; a step reporting its gradient norm adds up their grad_sq sums in one more), of grad_sq_sum, of lars_sq_sums, of the schedule-free scalars and switch, and of schedule_lrs.
// What needs the CUDA runtime (streams, capture, the device guard, launches) is behind device.h, which a host
// compiler replaces with an emulation of CUDA's execution model, so the tests run this file on the CPU. Nothing
// here reads device memory from the host: a step never synchronizes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "bucket.h"
#include "schedule.h"
#include "sgd_math.h"
#include "slots.h"
#include "work_list.h"
// Last: they include device.h, whose emulation spells CUDA's keywords as macros.
#include "cuda_kernels.h"
#include "cuda_launch.h"
#include "device.h"

namespace lfsgd {
namespace {

// Each LARS tensor's row of sums (lars_sq_sums), for a bucket whose work tables are on the device: a float64
// [n, kNumLarsSums] tensor there, zeros for the other tensors but (`grads_too`) their grad_sq sums.
inline at::Tensor lars_rows(const Work& work, const DeviceTables& tables, const at::Device& device,
                            device::Stream stream, at::ScalarType dtype, Weight weight, const float* grad_scale,
                            bool grads_too) {
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  const int64_t n = static_cast<int64_t>(work.tensors.size());
  at::Tensor rows = at::zeros({n, kNumLarsSums}, options);
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0) return rows;
  at::Tensor partials = at::zeros({num_chunks, kNumLarsSums}, options);
  dispatch_bucket_types(dtype, weight, [&](auto param, auto, auto weight_tag) {
    device::launch(&lars_sums_kernel<decltype(param), decltype(weight_tag)::value>, num_chunks, kThreads, stream,
                   tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1), tables.table<GroupHParams>(2),
                   partials.data_ptr<double>(), grad_scale, grads_too);
  });
  device::launch(&lars_rows_kernel, n, kThreads, stream, tables.table<TensorArgs>(0), partials.data_ptr<double>(),
                 rows.data_ptr<double>());
  return rows;
}

inline void check_on_device(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(device::on_device(tensor), "lightning_fusedsgd::", op, " (", device::kName, "): ", device::kName,
              " tensors only");
}

// The CUDA kernel of lightning_fusedsgd::sgd_step (the op: sgd_step_op in bucket.h).
void run_device(const Bucket& bucket) {
  const at::TensorList params = bucket.params;
  if (params.empty()) return;
  check_on_device(params[0], "sgd_step");
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Device device = params[0].device();
  const Work work = make_work(bucket);
  bool any_counts = false;
  for (const TensorArgs& args : work.tensors) {
    any_counts = any_counts || args.slots.count(kRoundingStep) != nullptr || args.slots.count(kEmaStep) != nullptr;
  }
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0 && !any_counts) return;

  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(device, stream, work, bucket.groups);
  StepRow row = bucket.row;
  // Unsharded LARS: the sums of each LARS tensor, reduced once into its row, which every block of it reads; a
  // step reporting its gradient norm takes every tensor's grad_sq there too, and adds them up.
  const bool reports = row.unscaled_grad_sq_sum != nullptr;
  const at::Tensor rows = (bucket.any_lars && row.lars_sq_sums == nullptr) || reports
                              ? lars_rows(work, tables, device, stream, params[0].scalar_type(), bucket.weight,
                                          row.grad_scale, reports)
                              : at::Tensor();
  if (rows.defined()) row.lars_sq_sums = rows.data_ptr<double>();
  if (reports) {
    device::launch(&grad_sq_total_kernel, 1, kThreads, stream, rows.data_ptr<double>(), n, row.unscaled_grad_sq_sum,
                   row.found_inf);
  }
  if (num_chunks > 0) {
    dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto aux, auto weight) {
      using P = decltype(param);
      using A = decltype(aux);
      constexpr Weight kWeight = decltype(weight)::value;
      const auto kernel =
          bucket.schedule_free ? &update_kernel<P, A, kWeight, true> : &update_kernel<P, A, kWeight, false>;
      device::launch(kernel, num_chunks, kThreads, stream, tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1),
                     tables.table<GroupHParams>(2), row);
    });
  }
  if (any_counts) {
    device::launch(&advance_counts_kernel, (n + 255) / 256, 256, stream, tables.table<TensorArgs>(0),
                   tables.table<GroupHParams>(2), n, row.found_inf);
  }
}

// lightning_fusedsgd::lars_sq_sums on the device (the op: lars_sq_sums_op in bucket.h): a float64
// [n, kNumLarsSums] table there (zeros for tensors without LARS), with no host sync.
at::Tensor lars_sq_sums_device(const Bucket& bucket) {
  const at::TensorList params = bucket.params;
  TORCH_CHECK(!params.empty(), "lightning_fusedsgd::lars_sq_sums: no params");
  check_on_device(params[0], "lars_sq_sums");
  const at::Device device = params[0].device();
  const Work work = make_work(bucket);
  if (work.chunks.empty()) return at::zeros({static_cast<int64_t>(params.size()), kNumLarsSums},
                                            at::TensorOptions().dtype(at::kDouble).device(device));
  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(device, stream, work, bucket.groups);
  return lars_rows(work, tables, device, stream, params[0].scalar_type(), bucket.weight, bucket.row.grad_scale,
                   /*grads_too=*/false);
}

// lightning_fusedsgd::grad_sq_sum on the device: a float64 scalar there, with no host sync.
at::Tensor grad_sq_sum_device(at::TensorList grads) {
  check_grads(grads);
  TORCH_CHECK(!grads.empty(), "lightning_fusedsgd::grad_sq_sum: no gradients");
  check_on_device(grads[0], "grad_sq_sum");
  const at::Device device = grads[0].device();
  std::vector<const void*> pointers;
  std::vector<ChunkArgs> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(grads.size()); ++t) {
    pointers.push_back(grads[t].data_ptr());
    append_chunks(chunks, t, grads[t].numel(), kBlockChunkElems);
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  if (chunks.empty()) return at::zeros({}, options);
  const device::Guard guard(device);
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload(
      device, stream,
      {{pointers.data(), pointers.size() * sizeof(void*)}, {chunks.data(), chunks.size() * sizeof(ChunkArgs)}});
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::Tensor partials = at::empty({num_chunks}, options);
  dispatch_bucket_types(grads[0].scalar_type(), Weight::kParam, [&](auto grad, auto, auto) {
    using P = decltype(grad);
    device::launch(&grad_sq_sum_kernel<P>, num_chunks, kThreads, stream, tables.table<const P*>(0),
                   tables.table<ChunkArgs>(1), partials.data_ptr<double>());
  });
  return partials.sum();
}

// lightning_fusedsgd::schedule_lrs on the device: one thread runs schedule_step (schedule.h).
void schedule_lrs_device(const at::Tensor& lrs, const at::Tensor& position, const at::Tensor& schedule,
                         const at::Tensor& peaks, const std::optional<at::Tensor>& applied, bool advance) {
  check_schedule_inputs(lrs, position, schedule, peaks, applied);
  check_on_device(lrs, "schedule_lrs");
  const device::Guard guard(lrs.device());
  device::launch(&schedule_kernel, 1, 1, device::current_stream(), lrs.data_ptr<double>(),
                 position.data_ptr<int64_t>(), schedule.data_ptr<double>(), schedule.numel(), peaks.data_ptr<double>(),
                 lrs.numel(), applied.has_value() ? applied->data_ptr<bool>() : nullptr, advance);
}

// lightning_fusedsgd::schedule_free_scalars on the device (the op: schedule_free_scalars_op in bucket.h).
void schedule_free_scalars_device(const at::Tensor& scalars, const std::vector<GroupHParams>& groups,
                                  const StepRow& row) {
  check_on_device(scalars, "schedule_free_scalars");
  if (groups.empty()) return;
  const device::Guard guard(scalars.device());
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload(scalars.device(), stream, {{groups.data(), groups.size() * sizeof(GroupHParams)}});
  device::launch(&schedule_free_scalars_kernel, 1, 1, stream, scalars.data_ptr<double>(),
                 tables.table<GroupHParams>(0), static_cast<int64_t>(groups.size()), row);
}

// lightning_fusedsgd::schedule_free_switch on the device (the op: schedule_free_switch_op in bucket.h).
void schedule_free_switch_device(const Bucket& bucket, bool train) {
  const at::TensorList params = bucket.params;
  if (params.empty()) return;
  check_on_device(params[0], "schedule_free_switch");
  const Work work = make_work(bucket);
  const int64_t num_chunks = static_cast<int64_t>(work.chunks.size());
  if (num_chunks == 0) return;
  const device::Guard guard(params[0].device());
  const device::Stream stream = device::current_stream();
  const DeviceTables tables = upload_work(params[0].device(), stream, work, bucket.groups);
  dispatch_bucket_types(params[0].scalar_type(), bucket.weight, [&](auto param, auto aux, auto weight) {
    device::launch(&schedule_free_switch_kernel<decltype(param), decltype(aux), decltype(weight)::value>,
                   num_chunks, kThreads, stream, tables.table<TensorArgs>(0), tables.table<ChunkArgs>(1),
                   tables.table<GroupHParams>(2), train);
  });
}

}  // namespace
}  // namespace lfsgd

TORCH_LIBRARY_IMPL(LFSGD_DEVICE_LIBRARY, LFSGD_DEVICE_DISPATCH, m) {
  m.impl("sgd_step", &lfsgd::sgd_step_op<lfsgd::run_device>);
  m.impl("grad_sq_sum", &lfsgd::grad_sq_sum_device);
  m.impl("lars_sq_sums", &lfsgd::lars_sq_sums_op<lfsgd::lars_sq_sums_device>);
  m.impl("schedule_lrs", &lfsgd::schedule_lrs_device);
  m.impl("schedule_free_scalars", &lfsgd::schedule_free_scalars_op<lfsgd::schedule_free_scalars_device>);
  m.impl("schedule_free_switch", &lfsgd::schedule_free_switch_op<lfsgd::schedule_free_switch_device>);
}