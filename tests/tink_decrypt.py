#!/usr/bin/env python3
"""Google Tink against tpmcrypt gcm files, for tests/tink_interop.rs.

The gcm payload of a tpmcrypt file is Tink's AES-GCM-HKDF streaming AEAD
byte for byte: the Tink key is the session key, the derived key size is
key_bits / 8, the ciphertext segment size is the header's, and the
associated data is the file's first payload_offset bytes (the tpmcrypt
header). Everything used here comes from
`tpmcrypt inspect --json -i ID --reveal-session-key` (session_key, key_bits,
segment_size, payload_offset) and the file's bytes; nothing else about the
tpmcrypt format is known to this script.

    tink_decrypt.py decrypt INSPECT_JSON FILE PLAINTEXT_OUT [--flip-ad-byte N]
        Decrypts FILE[payload_offset:] with AD = FILE[:payload_offset]
        (optionally with one AD byte flipped) and writes the plaintext.

    tink_decrypt.py encrypt INSPECT_JSON TEMPLATE PLAINTEXT FILE_OUT
        Encrypts PLAINTEXT with Tink under the session of TEMPLATE and writes
        TEMPLATE[:payload_offset] followed by Tink's ciphertext, which
        tpmcrypt must then decrypt.

Exit status: 0 success, 3 Tink rejected the ciphertext, 2 bad usage or tink
missing.
"""

import io
import json
import sys

TYPE_URL = "type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey"


def load_tink():
    try:
        import tink
        from tink import streaming_aead
        from tink.proto import aes_gcm_hkdf_streaming_pb2, common_pb2, tink_pb2
    except ImportError as e:
        print(f"tink_decrypt.py: cannot import tink: {e}", file=sys.stderr)
        sys.exit(2)
    return tink, streaming_aead, aes_gcm_hkdf_streaming_pb2, common_pb2, tink_pb2


def keyset_handle(keyset):
    """A KeysetHandle from a cleartext Keyset proto, with whichever API this
    version of tink offers."""
    try:
        from tink import cleartext_keyset_handle

        return cleartext_keyset_handle.from_keyset(keyset)
    except (ImportError, AttributeError):
        pass
    from tink import proto_keyset_format, secret_key_access

    return proto_keyset_format.parse(keyset.SerializeToString(), secret_key_access.TOKEN)


def primitive_for(info):
    """The StreamingAead for the session described by inspect's JSON."""
    tink, streaming_aead, gcm_pb2, common_pb2, tink_pb2 = load_tink()
    streaming_aead.register()

    key = gcm_pb2.AesGcmHkdfStreamingKey()
    key.version = 0
    key.key_value = bytes.fromhex(info["session_key"])
    key.params.derived_key_size = int(info["key_bits"]) // 8
    key.params.hkdf_hash_type = common_pb2.SHA256
    key.params.ciphertext_segment_size = int(info["segment_size"])

    keyset = tink_pb2.Keyset()
    keyset.primary_key_id = 1
    entry = keyset.key.add()
    entry.key_data.type_url = TYPE_URL
    entry.key_data.value = key.SerializeToString()
    entry.key_data.key_material_type = tink_pb2.KeyData.SYMMETRIC
    entry.status = tink_pb2.ENABLED
    entry.key_id = 1
    entry.output_prefix_type = tink_pb2.RAW

    return tink, keyset_handle(keyset).primitive(streaming_aead.StreamingAead)


def decrypt(info, encrypted_path, out_path, flip):
    offset = int(info["payload_offset"])
    with open(encrypted_path, "rb") as f:
        data = f.read()
    associated_data = bytearray(data[:offset])
    payload = data[offset:]
    if flip is not None:
        associated_data[flip] ^= 0x01
    tink, primitive = primitive_for(info)
    try:
        with primitive.new_decrypting_stream(io.BytesIO(payload), bytes(associated_data)) as s:
            plaintext = s.read()
    except tink.TinkError as e:
        print(f"tink rejected the ciphertext: {e}", file=sys.stderr)
        return 3
    with open(out_path, "wb") as f:
        f.write(plaintext)
    return 0


class _Sink(io.BytesIO):
    """A BytesIO whose contents survive close() (Tink closes its target)."""

    def close(self):
        self.final = self.getvalue()
        super().close()


def encrypt(info, template_path, plaintext_path, out_path):
    offset = int(info["payload_offset"])
    with open(template_path, "rb") as f:
        header = f.read()[:offset]
    with open(plaintext_path, "rb") as f:
        plaintext = f.read()
    _, primitive = primitive_for(info)
    sink = _Sink()
    with primitive.new_encrypting_stream(sink, header) as s:
        s.write(plaintext)
    with open(out_path, "wb") as f:
        f.write(header + sink.final)
    return 0


def main(argv):
    args = argv[1:]
    flip = None
    if "--flip-ad-byte" in args:
        i = args.index("--flip-ad-byte")
        flip = int(args[i + 1])
        del args[i : i + 2]
    if len(args) == 4 and args[0] == "decrypt":
        with open(args[1], encoding="utf-8") as f:
            info = json.load(f)
        return decrypt(info, args[2], args[3], flip)
    if len(args) == 5 and args[0] == "encrypt" and flip is None:
        with open(args[1], encoding="utf-8") as f:
            info = json.load(f)
        return encrypt(info, args[2], args[3], args[4])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
