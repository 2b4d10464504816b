"""`fa_numba.banks`: the wavefront rule on probes whose answers are worked out by hand from the definition
(32 banks of 4 bytes; one phase for 32-bit, half-warps for 64-bit, quarter-warps for 128-bit; per phase the
most distinct words one bank is asked for)."""

import pytest

from fa_numba import banks

WORD = banks.BANK_BYTES
LANES = range(banks.WARP)


def words(word_of_lane):
    """Byte addresses of a 32-bit access where lane t reads word word_of_lane(t)."""
    return [WORD * word_of_lane(t) for t in LANES]


def test_constants_are_the_sm70_to_sm90_shared_memory():
    assert (banks.BANKS, banks.BANK_BYTES, banks.WARP) == (32, 4, 32)
    assert [banks.phase_lanes(w) for w in (1, 2, 4, 8, 16)] == [32, 32, 32, 16, 8]


def test_consecutive_words_are_conflict_free():
    assert banks.wavefronts(words(lambda t: t), 4) == 1


def test_stride_two_words_is_a_two_way_conflict():
    # banks 2t mod 32: lanes t and t + 16 ask bank 2t for words 2t and 2t + 32
    assert banks.wavefronts(words(lambda t: 2 * t), 4) == 2


def test_stride_eight_words_is_an_eight_way_conflict():
    # banks 0, 8, 16, 24, each asked for 8 distinct words
    assert banks.wavefronts(words(lambda t: 8 * t), 4) == 8


def test_stride_thirty_two_words_is_a_thirty_two_way_conflict():
    assert banks.wavefronts(words(lambda t: 32 * t), 4) == 32


def test_stride_thirty_three_words_is_conflict_free():
    # the padded column of a (., 33) array: bank (33 t) mod 32 = t
    assert banks.wavefronts(words(lambda t: 33 * t), 4) == 1


def test_every_lane_reading_one_word_is_a_broadcast():
    assert banks.wavefronts(words(lambda t: 7), 4) == 1


def test_pairs_of_lanes_sharing_words_are_a_broadcast():
    assert banks.wavefronts(words(lambda t: t // 2), 4) == 1


def test_half_the_lanes_meeting_another_word_in_their_bank_cost_two():
    # lanes 0-15 read words 0-15; lanes 16-31 read words 32-47, banks 0-15 again
    assert banks.wavefronts(words(lambda t: t if t < 16 else 16 + t), 4) == 2


def test_one_lane_off_the_broadcast_word_costs_two():
    assert banks.wavefronts(words(lambda t: 32 if t == 31 else 0), 4) == 2


def test_sixteen_bit_neighbours_share_a_word():
    assert banks.wavefronts([2 * t for t in LANES], 2) == 1


def test_sixty_four_bit_consecutive_is_two_half_warp_phases():
    assert banks.wavefronts([8 * t for t in LANES], 8) == 2


def test_sixty_four_bit_stride_two_is_two_way_in_each_half_warp():
    # per half-warp lane t touches words 4t and 4t + 1: lanes t and t + 8 meet in both banks
    assert banks.wavefronts([16 * t for t in LANES], 8) == 4


def test_sixty_four_bit_broadcast_costs_one_per_half_warp():
    assert banks.wavefronts([64] * banks.WARP, 8) == 2


def test_one_twenty_eight_bit_consecutive_is_four_quarter_warp_phases():
    assert banks.wavefronts([16 * t for t in LANES], 16) == 4


def test_one_twenty_eight_bit_stride_two_is_two_way_in_each_quarter_warp():
    # per quarter-warp lane t touches words 8t .. 8t + 3: lanes t and t + 4 meet in four banks
    assert banks.wavefronts([32 * t for t in LANES], 16) == 8


def test_inactive_lanes_ask_for_nothing():
    assert banks.wavefronts({0: 0, 1: 128, 2: 256, 3: 384}, 4) == 4  # four words of bank 0
    assert banks.wavefronts({0: 0, 5: 128}, 4) == 2
    assert banks.wavefronts([None if t % 2 else 128 * t for t in LANES], 4) == 16  # 16 words of bank 0


def test_phases_without_an_active_lane_cost_nothing():
    assert banks.wavefronts({}, 4) == 0
    assert banks.wavefronts([None] * banks.WARP, 16) == 0
    assert banks.wavefronts({t: 16 * t for t in range(8)}, 16) == 1  # only the first quarter-warp
    assert banks.wavefronts({3: 0, 20: 8}, 8) == 2  # one lane in each half-warp


def test_misaligned_addresses_and_unknown_widths_and_lanes_are_errors():
    with pytest.raises(ValueError, match="multiple of the access width"):
        banks.wavefronts({0: 4}, 8)
    with pytest.raises(ValueError, match="width_bytes must be one of"):
        banks.wavefronts({0: 0}, 32)
    with pytest.raises(ValueError, match="outside the warp"):
        banks.wavefronts({32: 0}, 4)
    assert banks.wavefronts({0: 12}, 4) == 1


def test_ideal_is_one_wavefront_per_phase_the_lanes_fill():
    assert banks.ideal_wavefronts(32, 4) == 1
    assert banks.ideal_wavefronts(1, 4) == 1
    assert banks.ideal_wavefronts(0, 4) == 0
    assert banks.ideal_wavefronts(32, 8) == 2
    assert banks.ideal_wavefronts(17, 8) == 2
    assert banks.ideal_wavefronts(32, 16) == 4
    assert banks.ideal_wavefronts(9, 16) == 2
    with pytest.raises(ValueError, match="active_lanes"):
        banks.ideal_wavefronts(33, 4)


# Paired 128-bit loads (banks' docstring): the two probes are the Nsight Compute counts measured on an H100
# (forums.developer.nvidia.com/t/373160), the pairing condition an NVIDIA answer for CC 7.x (t/77228).
def test_one_twenty_eight_bit_load_whose_half_warps_each_read_one_address_costs_two():
    addresses = [0 if t < 16 else 32 for t in LANES]  # measured: 2 wavefronts (not 4)
    assert banks.is_paired(addresses, 16)
    assert banks.wavefronts(addresses, 16) == 2
    assert banks.wavefronts([48] * banks.WARP, 16) == 2  # a warp-wide broadcast: "from 4 to 2"


def test_one_twenty_eight_bit_load_shared_by_lanes_t_and_t_plus_16_is_not_paired():
    addresses = [32 * (t % 16) for t in LANES]  # measured: 8 wavefronts (2-way in every quarter-warp)
    assert not banks.is_paired(addresses, 16)
    assert banks.wavefronts(addresses, 16) == 8


def test_pairs_by_lane_xor_two_count_and_distinct_addresses_in_a_half_still_conflict():
    by_two = [16 * ((t // 4) * 2 + (t % 2)) for t in LANES]  # lane t and t ^ 2 share an address
    assert banks.is_paired(by_two, 16) and banks.wavefronts(by_two, 16) == 2 * 1
    by_four = [16 * (t % 4) for t in LANES]  # t%4*16: neither pairing holds (t/77228: 4 requests)
    assert not banks.is_paired(by_four, 16) and banks.wavefronts(by_four, 16) == 4
    conflicting = [0 if t % 16 < 8 else 512 for t in LANES]  # pairs hold; two words of banks 0-3 per half
    assert banks.is_paired(conflicting, 16) and banks.wavefronts(conflicting, 16) == 4


def test_pairing_is_for_128_bit_loads_only_and_a_lone_lane_breaks_it():
    halves = [0 if t < 16 else 32 for t in LANES]
    assert banks.wavefronts(halves, 16, "store") == 4
    assert not banks.is_paired(halves, 16, "store")
    assert banks.wavefronts([0 if t < 16 else 64 for t in LANES], 8) == 2  # 64-bit: half-warp phases as before
    assert not banks.is_paired({0: 0, 1: 0, 2: 0}, 16)  # lane 2's partners 3 (xor 1) and 0 (xor 2): 3 is absent
    assert banks.is_paired({0: 0, 1: 0}, 16)
    assert banks.ideal_wavefronts(32, 16, paired=True) == 2
    with pytest.raises(ValueError, match="kind must be one of"):
        banks.is_paired(halves, 16, "read")


# ldmatrix ("matrix"): lanes 8m .. 8m + 7 give the 16-byte rows of matrix m, one phase per matrix
def rows(stride_bytes, matrices):
    """Row addresses of an ldmatrix .x{matrices}: lane l gives row l % 8 of matrix l // 8, rows stride_bytes
    apart and matrices 16 bytes apart (the next 8 columns); lanes past the last matrix give none."""
    return [(lane % 8) * stride_bytes + 16 * (lane // 8) if lane < 8 * matrices else None for lane in LANES]


def test_ldmatrix_rows_padded_by_16_bytes_are_conflict_free():
    # rows 144 bytes apart (64 halves + 8 of pad): row r starts at bank 4r mod 32, its 4 words in banks
    # 4r .. 4r + 3, so the 8 rows of a matrix cover the 32 banks once: 1 wavefront per matrix
    assert banks.wavefronts(rows(144, 4), 16, "matrix") == 4
    assert banks.wavefronts(rows(144, 2), 16, "matrix") == 2


def test_ldmatrix_rows_128_bytes_apart_are_an_eight_way_conflict():
    # every row starts at bank 0: 8 rows ask banks 0..3 for 8 distinct words each
    assert banks.wavefronts(rows(128, 4), 16, "matrix") == 4 * 8


def test_ldmatrix_rows_48_bytes_apart_are_free_and_64_apart_conflict_four_ways():
    # 48: rows start at words 0, 12, 24, 36, .., 84, banks 0, 12, 24, 4, 16, 28, 8, 20: eight disjoint 4-bank
    # groups. 64: banks 0, 16, 0, 16, ..: rows 0, 2, 4, 6 ask banks 0..3 for 4 distinct words each
    assert banks.wavefronts(rows(48, 1), 16, "matrix") == 1
    assert banks.wavefronts(rows(64, 1), 16, "matrix") == 4


def test_ldmatrix_is_never_paired_and_has_16_byte_rows():
    same = [0 if lane < 16 else 16 for lane in LANES]  # a load like this would be paired (2 wavefronts)
    assert banks.is_paired(same, 16, "load") and not banks.is_paired(same, 16, "matrix")
    with pytest.raises(ValueError, match="16-byte rows"):
        banks.wavefronts(words(lambda t: t), 4, "matrix")
