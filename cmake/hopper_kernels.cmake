# The Hopper (sm_90a) kernels a full build instantiates: one row per (direction, head dim) with the
# variants it has, each crossed with JAGFLASH_HOPPER_DTYPES (bf16, fp16). CMakeLists.txt generates
# one translation unit per (dtype, head dim, variant, direction) of it, for the head dims the build
# keeps (JAGFLASH_HEAD_DIMS, and JAGFLASH_FORWARD_HEAD_DIMS / JAGFLASH_BACKWARD_HEAD_DIMS per
# direction), and the registry's tables (kernels/hopper_registry.cu.in) list exactly those.
#
# Variants: none (no score modifier; the forward's tile variants, kernels/fwd/variants.hpp),
# softcap, alibi, relative_bias (the score modifiers, each with one tile), padded (the kernel for
# the head dims below this one, PaddedHeadDim) and sparse (a block-sparse map, jf_block_mask).
#  - 96 and 192 have their own and the padded kernel only: they serve the head dims up to them
#    (72-96, 136-192) without a modifier or a map; every other call runs the next head dim up.
#  - A block map at 64 and 128 only.
#  - The backward at 128 without a relative bias: its per-score table reads leave the consumers
#    short of registers (ptxas spills, check_sass refuses them), so the oracle serves that call.
#  - The backward at 256 (the wide kernel, mainloop_bwd_wide.cuh) with softcap and ALiBi; not with a
#    relative bias (its table reads spill inside the GEMM loop: check_sass refuses it) nor a map.
# Row: "<direction> <head dim> <variant>;<variant>...", variants in the order of
# JAGFLASH_HOPPER_VARIANTS (the generated files' and tables' order).
set(JAGFLASH_HOPPER_VARIANTS none softcap alibi relative_bias padded sparse)
set(JAGFLASH_HOPPER_KERNELS
  "fwd 64 none,softcap,alibi,relative_bias,padded,sparse"
  "fwd 96 none,padded"
  "fwd 128 none,softcap,alibi,relative_bias,padded,sparse"
  "fwd 192 none,padded"
  "fwd 256 none,softcap,alibi,relative_bias,padded"
  "bwd 64 none,softcap,alibi,relative_bias,padded,sparse"
  "bwd 96 none,padded"
  "bwd 128 none,softcap,alibi,padded,sparse"
  "bwd 192 none,padded"
  "bwd 256 none,softcap,alibi,padded")

# Sets `out` to TRUE when the table has `variant` for (direction, head dim).
function(jagflash_hopper_kernel_exists out direction head_dim variant)
  set(found FALSE)
  foreach(row IN LISTS JAGFLASH_HOPPER_KERNELS)
    string(REPLACE " " ";" fields "${row}")
    list(GET fields 0 row_direction)
    list(GET fields 1 row_head_dim)
    list(GET fields 2 row_variants)
    string(REPLACE "," ";" row_variants "${row_variants}")
    if(row_direction STREQUAL direction AND row_head_dim STREQUAL head_dim AND variant IN_LIST row_variants)
      set(found TRUE)
    endif()
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()
