/* Minimal stand-in for <hip/hip_runtime_api.h>, used only when the real HIP headers are absent.
 * Declares exactly the types and the three functions hip_cumask.c uses (via dlsym). */
#ifndef RS_HIP_SHIM_H
#define RS_HIP_SHIM_H
#include <stdint.h>

typedef enum hipError_t {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorSharedObjectInitFailed = 303,
    hipErrorNotFound = 500
} hipError_t;

typedef struct ihipStream_t* hipStream_t;

hipError_t hipExtStreamCreateWithCUMask(hipStream_t* stream, uint32_t cuMaskSize, const uint32_t* cuMask);
hipError_t hipExtStreamGetCUMask(hipStream_t stream, uint32_t cuMaskSize, uint32_t* cuMask);
hipError_t hipStreamDestroy(hipStream_t stream);
#endif
