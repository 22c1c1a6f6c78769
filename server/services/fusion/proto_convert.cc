#include "server/services/fusion/proto_convert.h"

namespace arfuse {
namespace {

TensorRef ToRef(bool present, const v1::RegionRef& ref) {
  TensorRef out;
  out.present = present;
  out.region_id = ref.region_id();
  out.generation = ref.generation();
  out.offset = ref.offset();
  return out;
}

}  // namespace

RegionSpec ToRegionSpec(const v1::RegisterRegionRequest& req) {
  RegionSpec spec;
  spec.name = req.name();
  spec.byte_size = req.byte_size();
  switch (req.memory_case()) {
    case v1::RegisterRegionRequest::kCudaIpc:
      spec.kind = MemoryKind::kCudaIpc;
      spec.cuda_handle = req.cuda_ipc().handle();
      spec.device_id = req.cuda_ipc().device_id();
      break;
    case v1::RegisterRegionRequest::kHostShm:
      spec.kind = MemoryKind::kHostShm;
      spec.shm_name = req.host_shm().shm_name();
      break;
    case v1::RegisterRegionRequest::kHostFd:
      spec.kind = MemoryKind::kHostShm;
      spec.host_by_fd = true;
      spec.fd_ticket = req.host_fd().fd_ticket();
      break;
    case v1::RegisterRegionRequest::MEMORY_NOT_SET:
      break;
  }
  return spec;
}

OpRequest ToOpRequest(const v1::OpSpec& op) {
  OpRequest out;
  out.pattern = static_cast<int32_t>(op.pattern());
  out.dtype = static_cast<int32_t>(op.dtype());
  out.hidden = op.hidden();
  out.max_tokens = op.max_tokens();
  if (op.has_eps()) out.eps = op.eps();
  out.input = ToRef(op.has_input(), op.input());
  out.output = ToRef(op.has_output(), op.output());
  out.residual_in = ToRef(op.has_residual_in(), op.residual_in());
  out.residual_out = ToRef(op.has_residual_out(), op.residual_out());
  out.norm_out = ToRef(op.has_norm_out(), op.norm_out());
  out.gamma = ToRef(op.has_gamma(), op.gamma());
  out.quant_out = ToRef(op.has_quant_out(), op.quant_out());
  out.scale = ToRef(op.has_scale(), op.scale());
  out.scale_layout = static_cast<int32_t>(op.scale_layout());
  return out;
}

void ToRegionInfoProto(const RegionInfo& info, v1::RegionInfo* out) {
  out->set_region_id(info.region_id);
  out->set_generation(info.generation);
  out->set_name(info.name);
  out->set_byte_size(info.byte_size);
  // MemoryKind numbers match arfuse.v1.DeviceKind.
  out->set_device(static_cast<v1::DeviceKind>(info.kind));
  out->set_in_flight(info.in_flight);
}

}  // namespace arfuse
