/* simgpu images: what a module holds, read from the code a program loads or links.
 *
 * simgpu runs no device code, but it reads the images programs hand the driver, so that
 * a module knows its kernels (cuModuleGetFunction of a name the image lacks is
 * CUDA_ERROR_NOT_FOUND), a kernel reports the resources its cubin records
 * (cuFuncGetAttribute), a cubin built for another GPU is refused
 * (CUDA_ERROR_NO_BINARY_FOR_GPU), and the linker (cuLink*) gives back a real image.
 * Formats read: PTX text (.version, .target, .entry and its .param list, .maxntid/.reqntid),
 * CUDA ELF (cubins and relocatable objects: entry symbols, .nv.info register and frame
 * sizes, .nv.info.<kernel> thread limits and parameters, .nv.shared.<kernel> sizes, the
 * OBJECT symbols of global and constant memory: cuModuleGetGlobal), fatbins (the best entry
 * for the device, as the driver picks it; compressed entries cannot be read here), the
 * fatbin wrapper nvcc embeds in host code, and ar archives of objects (libraries).
 * Anything else is a stand-in image: simgpu's own convention, whose every kernel name
 * resolves (tests load "image" and launch sim_<N>us).
 */
#ifndef SIMGPU_IMAGE_H
#define SIMGPU_IMAGE_H

#include <stddef.h>

/* what the caller says the data is (the CUjitInputType values), or any image */
enum { IMG_CUBIN = 0, IMG_PTX = 1, IMG_FATBIN = 2, IMG_OBJECT = 3, IMG_LIBRARY = 4, IMG_NVVM = 5,
       IMG_ANY = 100 };

struct simgpu_param {
    unsigned offset;    /* in the kernel's parameter space */
    unsigned size;      /* bytes */
};

struct simgpu_kernel {
    char *name;
    int regs;           /* registers per thread (0: not known, e.g. PTX simgpu does not compile) */
    int local_bytes;    /* per-thread local memory (the frame) */
    int shared_bytes;   /* static shared memory per block */
    int max_threads;    /* .maxntid/.reqntid or the cubin's limit; 0: none given */
    int params_known;   /* 1: nparams/params say what the kernel takes (cubin EIATTR_KPARAM_INFO, PTX .param) */
    int nparams;
    struct simgpu_param *params;   /* by ordinal (owned by the image) */
};

/* A variable of the image's global or constant memory (__device__, __constant__,
 * __managed__): an OBJECT symbol of a .nv.global* or .nv.constant* section of a CUDA ELF. */
struct simgpu_global {
    char *name;
    unsigned long long size;    /* the symbol's st_size */
    unsigned long long align;   /* its section's alignment (at least 1) */
    unsigned char *init;        /* its initial bytes; NULL: zeros (a NOBITS section) */
};

struct simgpu_image {
    int names_known;    /* 0: a stand-in (or unreadable compressed) image: any name resolves */
    int arch;           /* the SM the code targets, e.g. 86 (cubin: its SASS; PTX: .target) */
    int ptx_version;    /* PTX ISA of PTX code, e.g. 80 for 8.0; 0 for SASS */
    struct simgpu_kernel *kernels;
    size_t count;
    struct simgpu_global *globals;   /* read from CUDA ELF only: PTX and stand-ins have none here */
    size_t nglobals;
};

/* Read `data` (`size` bytes; 0 = find the size from the data, as cuModuleLoadData must)
 * as `kind` for a device of compute capability `cc` (86 for 8.6).  Returns a CUresult;
 * on failure a one-line reason is in `log`. */
int simgpu_image_read(const void *data, size_t size, int kind, int cc, struct simgpu_image *out, char *log,
                      size_t loglen);
/* Add `from`'s kernels to `into` (the linker); a name defined twice is an error. */
int simgpu_image_merge(struct simgpu_image *into, const struct simgpu_image *from, char *log, size_t loglen);
/* The image as a CUDA ELF cubin for `cc` whose kernels simgpu_image_read reads back
 * exactly; variables are not written (malloc'd; NULL when out of memory). */
void *simgpu_image_write(const struct simgpu_image *img, int cc, size_t *size);
const struct simgpu_kernel *simgpu_image_find(const struct simgpu_image *img, const char *name);
const struct simgpu_global *simgpu_image_global(const struct simgpu_image *img, const char *name);
void simgpu_image_free(struct simgpu_image *img);

#endif
