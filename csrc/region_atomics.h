/* region_atomics.h — atomic accessors for the controller's side of the shared files.
 *
 * The shim updates usage fields with atomic read-modify-writes while the controller
 * (vgpu-ctl reap, resize) works on the same mapping; Python has no atomic operations of
 * its own, so the cffi binding exposes these (same orderings as the shim's LOAD/STORE).
 */
#ifndef VGPU_REGION_ATOMICS_H
#define VGPU_REGION_ATOMICS_H

#include <stdint.h>

/* cffi:begin */
uint64_t vgpu_load_u64(uint64_t *p);
void vgpu_store_u64(uint64_t *p, uint64_t v);
uint64_t vgpu_exchange_u64(uint64_t *p, uint64_t v);
uint64_t vgpu_sub_u64(uint64_t *p, uint64_t v);
uint32_t vgpu_load_u32(uint32_t *p);
void vgpu_store_u32(uint32_t *p, uint32_t v);
int32_t vgpu_load_i32(int32_t *p);
void vgpu_store_i32(int32_t *p, int32_t v);
/* cffi:end */

#endif
