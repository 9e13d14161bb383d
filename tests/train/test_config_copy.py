"""`mxmoe config copy NAME DEST`: a DEST naming a missing folder ("newdir/") wrote a file named
"newdir"; a DEST in a missing folder failed with a bare "[Errno 2] ..." naming no argument. Both
are one-line errors naming DEST and what is expected, and nothing is written."""

from mxmoe import cli, configs


def test_a_missing_folder_is_refused_naming_dest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "copy", "debug_moe", "newdir/"]) == 2
    err = capsys.readouterr().err
    assert "DEST 'newdir/': no such folder; create it first, or give a file path" in err, err
    assert not (tmp_path / "newdir").exists()

    assert cli.main(["config", "copy", "debug_moe", "no/such/x.toml"]) == 2
    err = capsys.readouterr().err
    assert "DEST 'no/such/x.toml': folder 'no/such' does not exist" in err and "Errno" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_with_a_slash_gets_name_toml(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    assert cli.main(["config", "copy", "debug_moe", "d/"]) == 0
    assert (tmp_path / "d" / "debug_moe.toml").read_text() == configs.path("debug_moe").read_text()


def test_a_copy_that_cannot_be_written_names_dest(capsys):
    """The shipped file itself (with --force) and a folder no file can be made in were shutil's
    "PosixPath(...) and PosixPath(...) are the same file" and a bare "[Errno 2] ..."."""
    shipped = str(configs.path("debug_moe"))
    before = configs.path("debug_moe").read_text()
    assert cli.main(["config", "copy", "debug_moe", shipped, "--force"]) == 2
    err = capsys.readouterr().err
    assert f"DEST {shipped!r} is the shipped config itself" in err and "PosixPath" not in err, err
    assert configs.path("debug_moe").read_text() == before
    assert cli.main(["config", "copy", "debug_moe", "/proc/x.toml"]) == 2
    assert "DEST '/proc/x.toml': cannot write '/proc/x.toml' (" in capsys.readouterr().err
