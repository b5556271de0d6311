/* CU-masked HIP streams for rapidserve, loading libamdhip64.so with dlopen at first use.
 * Each rs_* function returns the hipError_t of the underlying HIP call; when the library or
 * symbol cannot be loaded it returns hipErrorSharedObjectInitFailed (303) / hipErrorNotFound (500).
 * The library path is given by rs_set_library_path (NULL -> "libamdhip64.so"). */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef RS_USE_HIP_SHIM
#include "hip_shim.h"
#else
#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#include <hip/hip_runtime_api.h>
#endif

#define RS_ERR_LOAD 303 /* hipErrorSharedObjectInitFailed */
#define RS_ERR_SYMBOL 500 /* hipErrorNotFound */

typedef hipError_t (*create_fn)(hipStream_t*, uint32_t, const uint32_t*);
typedef hipError_t (*get_fn)(hipStream_t, uint32_t, uint32_t*);
typedef hipError_t (*destroy_fn)(hipStream_t);

static void* g_lib = NULL;
static char g_path[4096] = "libamdhip64.so";

int rs_set_library_path(const char* path) {
    if (g_lib != NULL) {
        dlclose(g_lib);
        g_lib = NULL;
    }
    const char* p = (path != NULL && path[0] != '\0') ? path : "libamdhip64.so";
    if (strlen(p) >= sizeof(g_path)) return (int)hipErrorInvalidValue;
    strcpy(g_path, p);
    return 0;
}

const char* rs_last_dl_error(void) {
    const char* e = dlerror();
    return e != NULL ? e : "";
}

static void* rs_sym(const char* name, int* err) {
    if (g_lib == NULL) {
        g_lib = dlopen(g_path, RTLD_NOW | RTLD_LOCAL);
        if (g_lib == NULL) {
            *err = RS_ERR_LOAD;
            return NULL;
        }
    }
    void* f = dlsym(g_lib, name);
    if (f == NULL) *err = RS_ERR_SYMBOL;
    return f;
}

int rs_create_cu_mask_stream(uint32_t n, const uint32_t* mask, void** out_stream) {
    int err = 0;
    create_fn f = (create_fn)rs_sym("hipExtStreamCreateWithCUMask", &err);
    if (f == NULL) return err;
    hipStream_t s = NULL;
    hipError_t rc = f(&s, n, mask);
    if (out_stream != NULL) *out_stream = (rc == hipSuccess) ? (void*)s : NULL;
    return (int)rc;
}

int rs_get_cu_mask(void* stream, uint32_t n, uint32_t* out) {
    int err = 0;
    get_fn f = (get_fn)rs_sym("hipExtStreamGetCUMask", &err);
    if (f == NULL) return err;
    return (int)f((hipStream_t)stream, n, out);
}

int rs_destroy_stream(void* stream) {
    int err = 0;
    destroy_fn f = (destroy_fn)rs_sym("hipStreamDestroy", &err);
    if (f == NULL) return err;
    return (int)f((hipStream_t)stream);
}
