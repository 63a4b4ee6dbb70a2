// One launch of an empty kernel on `stream` (launch_floor.cu), by each route: the <<<>>> syntax (which pushes
// and pops its configuration around a cudaLaunchKernel), cudaLaunchKernel, cudaLaunchKernelEx without and with
// the programmatic-dependent-launch attribute (PDL, the combine's from SM90 on), and the driver's cuLaunchKernel.
// launch_runtime takes `smem` bytes of dynamic shared memory (over 48 KB: allowed first by allow_launch_smem), as
// the attention kernels do.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

cudaError_t launch_chevrons(cudaStream_t stream);
cudaError_t allow_launch_smem(int bytes);
cudaError_t launch_runtime(cudaStream_t stream, int smem = 0);
cudaError_t launch_ex(cudaStream_t stream, bool pdl);
cudaError_t launch_driver(cudaStream_t stream);
